"""A suite's runs as Ray tasks (``slotbench suite FILE --ray [ADDRESS]``).

Each run is one task that reserves what it uses: a real-device run its device threads plus one CPU for
its host loop, a simulated run one CPU. The task runs ``execute`` into a scratch directory on its worker
and returns the run directory as a tar archive, so the driver needs no shared file system; the driver
unpacks each beside OUT and renames it into place whole. A task whose worker dies is retried
``MAX_RETRIES`` times by Ray, then recorded as failed with the reason; a run that fails inside keeps its
own exit code and files. Ctrl-C cancels what is outstanding; what finished is kept.

Ray is the optional extra ``.[ray]``. On a cluster every worker needs slotbench installed (or a
``runtime_env`` that installs it); traces given by path must exist on the workers.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from harness.app import execute
from harness.errors import UserError
from harness.options import RunOptions
from harness.suite.spec import RunResult, SuiteRun
from strategies.runtime.device.compute import resolve_threads

MAX_RETRIES = 2


def cpus_for(opts: RunOptions) -> int:
    return 1 if opts.device == "sim" else resolve_threads(opts.device_threads) + 1


def run_remote(opts: RunOptions, name: str, die: bool = False) -> tuple[int, bytes | None, str | None]:
    """On a worker: (exit code, the run directory as tar.gz, or why there is none)."""
    if die:  # test hook: the worker process dies as if killed
        os._exit(1)
    with tempfile.TemporaryDirectory(prefix="slotbench-") as tmp:
        d = Path(tmp) / name
        try:
            outcome = execute(opts, d, force=True, progress=False, report=False, log=lambda _msg: None)
        except UserError as exc:
            return 2, None, str(exc)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(d, arcname=".")
        return outcome.exit_code, buf.getvalue(), None


def unpack(archive: bytes, dest: Path) -> None:
    """Extract beside ``dest`` and rename into place, replacing what was there."""
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(staging, filter="data")
    if dest.exists():
        shutil.rmtree(dest)
    staging.chmod(0o755)
    os.replace(staging, dest)


@contextmanager
def ray_session(address: str) -> Iterator[None]:
    """Ray for as long as the block runs: a local Ray when ``address`` is empty, else a connection to
    ``address``; one start for every round of a capacity search (a local start costs seconds). Shut down on
    the way out only if this started it."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install -e '.[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"--ray {address or '(local)'}: {exc}") from None
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run_on_ray(runs: list[SuiteRun], out: Path, address: str, progress: bool,
               die_in: frozenset[str] = frozenset()) -> tuple[dict[str, RunResult], bool]:
    """Run ``runs`` as Ray tasks (a local Ray when ``address`` is empty, unless a ``ray_session`` is open);
    results by run name, and whether Ctrl-C stopped it. ``die_in``: runs whose worker is killed (a test hook)."""
    with ray_session(address):
        return _run_tasks(runs, out, progress, die_in)


def _run_tasks(runs: list[SuiteRun], out: Path, progress: bool,
               die_in: frozenset[str]) -> tuple[dict[str, RunResult], bool]:
    import ray

    task = ray.remote(run_remote)
    pending = {task.options(num_cpus=cpus_for(r.opts), max_retries=MAX_RETRIES).remote(r.opts, r.name,
                                                                                        r.name in die_in): r
               for r in runs}
    results: dict[str, RunResult] = {}
    bar = tqdm(total=len(runs), desc="runs", unit="run", file=sys.stderr, disable=not progress)
    interrupted = False
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                run = pending.pop(ref)
                try:
                    code, archive, error = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died (after retries) or the task raised
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    results[run.name] = RunResult(1, f"{type(exc).__name__}: {reason}")
                else:
                    if archive is not None:
                        unpack(archive, out / run.name)
                    results[run.name] = RunResult(code, error)
                bar.update(1)
    except KeyboardInterrupt:
        interrupted = True
        for ref in pending:
            ray.cancel(ref, force=True)
    finally:
        bar.close()
    return results, interrupted
