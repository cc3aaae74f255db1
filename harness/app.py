"""``slotbench run``: a trace, a model and a list of strategies → one run directory.

Layout (all times are seconds since the run start on one monotonic clock)::

    OUT/run.json                       resolved options, versions, seed, device, trace source and sha256
    OUT/summary.csv, summary.json      one row per strategy
    OUT/report.html                    the HTML report
    OUT/<strategy>/requests.parquet    one row per request
    OUT/<strategy>/tokens.jsonl        tokens and their times per request
    OUT/<strategy>/iterations.parquet  one row per iteration
    OUT/<strategy>/slots.parquet       one row per slot tenure (who held which request slot when)
    OUT/<strategy>/timeline.json       Chrome trace: host and device lanes
    OUT/<strategy>/slices.csv          with --slice-duration: each time window's metrics
    OUT/endpoint/server_metrics.parquet  with --endpoint --scrape-interval: the server's /metrics over time
    OUT/<strategy>/vllm_bench.json     the strategy's run as `vllm bench serve --save-result --save-detailed`

The directory is assembled beside OUT and renamed into place at the end, so an existing OUT is never
half-overwritten; every file inside is written atomically too.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.errors import UserError
from harness.measure import Measured, collector_paused, frozen_heap, run_strategies
from harness.options import RunOptions
from harness.output.run_files import write_run_files
from harness.plan import Plan, resolve_plan

EXIT_FAULT, EXIT_INTERRUPTED = 1, 130


@dataclass
class RunOutcome:
    out: Path
    summary: pd.DataFrame
    exit_code: int
    notes: list[str] = dataclasses.field(default_factory=list)  # printed under the summary (rejections)


def prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")


def _swap_into_place(staging: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{time.time_ns()}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def execute(opts: RunOptions, out: Path, *, force: bool = False, progress: bool = True, report: bool = True,
            fault: tuple[str, int] | None = None, log: Callable[[str], None] | None = None) -> RunOutcome:
    """Run every strategy of ``opts`` and write the run directory, in three stages called once each: options →
    a resolved plan (``plan.py``) → each strategy run and written (``measure.py``) → the run's files and report,
    swapped into place. ``fault`` = (strategy, iteration) injects an engine exception there (a test hook)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    prepare_out(out, force)
    plan = resolve_plan(opts, log)
    staging = staging_dir(out)
    measured = Measured()
    with frozen_heap():
        try:
            run_strategies(plan, staging, measured, progress=progress, fault=fault, log=log)
        finally:  # whatever was measured is written, even when a strategy was cut short
            summary = write_run(staging, out, plan, measured, report, log)
    runs = measured.runs
    code = EXIT_INTERRUPTED if any(r.interrupted for r in runs) else EXIT_FAULT if any(r.error for r in runs) else 0
    return RunOutcome(out, summary, code, measured.notes)


def staging_dir(out: Path) -> Path:
    """Where ``out`` is assembled, beside it (``write_run`` renames it into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    staging.chmod(0o755)
    return staging


def write_run(staging: Path, out: Path, plan: Plan, measured: Measured, report: bool,
               log: Callable[[str], None]) -> pd.DataFrame:
    """The run's own files (run.json, the summary) and report beside the strategies', then ``out`` swapped in."""
    summary = pd.DataFrame(measured.rows)
    write_run_files(staging, plan.opts, plan.executor, plan.sim_info, plan.trace, plan.model_cfg, summary,
                    measured.runs)
    if report and measured.rows:
        from reports.html import write_report

        try:  # the measurements matter more than the page: never lose them to a report failure
            with collector_paused():
                write_report([staging], staging / "report.html", names=[out.name], frames=measured.frames)
        except Exception as exc:
            log(f"error: report not written: {type(exc).__name__}: {exc}")
    _swap_into_place(staging, out)
    return summary
