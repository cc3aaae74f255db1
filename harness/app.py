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
    OUT/<strategy>/vllm_bench.json     the strategy's run as `vllm bench serve --save-result --save-detailed`

The directory is assembled beside OUT and renamed into place at the end, so an existing OUT is never
half-overwritten; every file inside is written atomically too.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from harness.context_length import resolve_max_seq_len
from harness.errors import UserError
from harness.options import RunOptions
from harness.output.rejections import rejection_note
from harness.output.run_files import write_run_files
from harness.output.strategy_dir import write_strategy
from harness.plan import check_draft_model, check_encoder_inputs, load_model, make_trace, resolve_executor
from harness.runner import StrategyRun, build_requests, request_ids, run_strategy
from harness.traces.trace import TraceRequest
from reports.run_data import StrategyFrames

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
    """Run every strategy of ``opts`` and write the run directory. ``fault`` = (strategy, iteration)
    injects an engine exception there (a test hook)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    prepare_out(out, force)
    trace = make_trace(opts)
    request_ids(trace.requests)  # refused here, before anything is written, if a generated id is a given one
    for note in trace.notes:
        log(f"note: {trace.source}: {note}")
    if trace.skipped:
        log(f"note: {trace.source}: skipped {trace.skipped} failed rows (zero response tokens)")
    model_cfg, model = load_model(opts)
    opts = resolve_max_seq_len(opts, model_cfg)
    check_encoder_inputs(opts, model_cfg, trace)
    check_draft_model(opts, model_cfg)
    executor, sim_info = resolve_executor(opts)
    defaults = opts.sampling_defaults()
    # The decoder state and block tables hold as many beam rows per slot as the widest request needs.
    if executor.speculative is not None and model_cfg.is_encoder_decoder:
        raise UserError("--speculative-config: an encoder–decoder model does not speculate here")
    widest = max([defaults.beam_width] + [int((t.sampling or {}).get("beam_width", 1)) for t in trace.requests])
    if widest != executor.max_beam_width:
        try:
            executor = dataclasses.replace(executor, max_beam_width=widest)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    warm = [TraceRequest(0.0, min(t.input_tokens, opts.max_seq_len // 2), min(t.output_tokens, 16),
                         encoder_tokens=min(t.encoder_tokens, opts.max_seq_len // 2))
            for t in trace.requests[: opts.warmup]]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    staging.chmod(0o755)
    runs: list[StrategyRun] = []
    rows: list[dict] = []
    frames: dict[str, StrategyFrames] = {}  # what was written, for the report
    notes: list[str] = []
    with _frozen_heap():
        try:
            for name in opts.strategies:
                requests = build_requests(list(trace.requests), defaults, model_cfg.vocab_size, opts.seed,
                                          max_seq_len=opts.max_seq_len)
                bar = tqdm(total=len(requests), desc=f"{name:>8}", unit="req", file=sys.stderr, disable=not progress,
                           mininterval=0.5, leave=True)
                warmup = build_requests(warm, defaults, model_cfg.vocab_size, opts.seed + 1, "warmup-")
                run = run_strategy(name, model_cfg, model, executor, requests, max_concurrency=opts.max_concurrency,
                                   warmup=warmup, on_end=lambda _r, bar=bar: bar.update(1),
                                   fault_at_iteration=fault[1] if fault and fault[0] == name else None,
                                   profile_iters=opts.profile_range())
                bar.close()
                runs.append(run)
                with _collector_paused():
                    row, frames[name] = write_strategy(staging, run, opts)
                rows.append(row)
                note = rejection_note(name, run.requests)
                if note:
                    notes.append(note)
                if run.error:
                    log(f"error: {name} stopped early: {run.error}")
                if run.interrupted:
                    break
        finally:
            # Whatever was measured is written, even when the loop above was cut short.
            summary = pd.DataFrame(rows)
            write_run_files(staging, opts, executor, sim_info, trace, model_cfg, summary, runs)
            if report and rows:
                from reports.html import write_report

                try:  # the measurements matter more than the page: never lose them to a report failure
                    with _collector_paused():
                        write_report([staging], staging / "report.html", names=[out.name], frames=frames)
                except Exception as exc:
                    log(f"error: report not written: {type(exc).__name__}: {exc}")
            _swap_into_place(staging, out)
    code = EXIT_INTERRUPTED if any(r.interrupted for r in runs) else EXIT_FAULT if any(r.error for r in runs) else 0
    return RunOutcome(out, summary, code, notes)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No automatic collection while a strategy's files or the run's report are written: the writing makes
    ~10^5 dicts and lists (the timeline's events, the vLLM file's lists, the figures' data) that reference
    counting frees, and the full collections they set off walk every record the run kept (on the 70B run,
    two of 0.09 s in 1.5 s of writing its files, one of 0.1 s in its report)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """What is alive on entry (imported modules, the model, the trace) leaves the cyclic collector's
    generations until the run is written, as vLLM freezes its heap after start-up (``freeze_gc_heap``): a full
    collection otherwise walks all of it, 0.1-0.2 s each here, in a measured step as readily as in the
    writing (the 70B run's three took 0.39 s of its 9 s; frozen, two took 0.14 s). On exit everything goes
    back to the collector, so that a later run in this process (a suite's) frees what this one left."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
