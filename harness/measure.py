"""``execute``'s second stage: run each strategy of a plan and write its directory as soon as it ends, so that a
later fault or interrupt loses nothing already measured (``harness/app.py``)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from harness.options import RunOptions
from harness.options.endpoint import ENDPOINT
from harness.output.rejections import rejection_note
from harness.output.strategy_dir import write_strategy
from harness.plan import Plan
from harness.runner import StrategyRun, build_requests, run_strategy
from reports.run_data import StrategyFrames


@dataclass
class Measured:
    """What the strategies have measured so far, each already written (filled as they end)."""

    runs: list[StrategyRun] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # summary rows, one per strategy
    frames: dict[str, StrategyFrames] = field(default_factory=dict)  # what was written, for the report
    notes: list[str] = field(default_factory=list)  # printed under the summary (rejections)

    def add(self, staging: Path, run: StrategyRun, opts: RunOptions) -> None:
        """``run`` written into ``staging/<strategy>/``, and kept: its summary row, its frames, its note."""
        self.runs.append(run)
        with collector_paused():
            row, self.frames[run.name] = write_strategy(staging, run, opts)
        self.rows.append(row)
        note = rejection_note(run.name, run.requests)
        if note:
            self.notes.append(note)


def run_strategies(plan: Plan, staging: Path, measured: Measured, *, progress: bool,
                   fault: tuple[str, int] | None, log: Callable[[str], None]) -> None:
    """Each strategy in turn, over the same requests; stops after an interrupted one."""
    opts, cfg = plan.opts, plan.model_cfg
    for name in opts.strategies:
        requests = build_requests(list(plan.trace.requests), plan.defaults, cfg.vocab_size, opts.seed,
                                  max_seq_len=opts.max_seq_len)
        bar = tqdm(total=len(requests), desc=f"{name:>8}", unit="req", file=sys.stderr, disable=not progress,
                   mininterval=0.5, leave=True)
        warmup = build_requests(plan.warm, plan.defaults, cfg.vocab_size, opts.seed + 1, "warmup-")
        run = run_strategy(name, cfg, plan.model, plan.executor, requests,
                           max_concurrency=opts.max_concurrency or plan.trace.max_concurrency,
                           warmup=warmup, on_end=lambda _r, bar=bar: bar.update(1),
                           fault_at_iteration=fault[1] if fault and fault[0] == name else None,
                           profile_iters=opts.profile_range(), cls=plan.client if name == ENDPOINT else None,
                           request_timeout_s=opts.request_timeout or plan.trace.request_timeout_s,
                           stage_drain=plan.trace.stage_drain)
        bar.close()
        measured.add(staging, run, opts)
        for f in run.extras.get("faults", []):  # a fleet's worker that died (strategies/fleet.py), one line each
            log(f"error: {name}: worker {f['worker']} died at {f['time_s']:.3f} s ({f['found']}): {f['cause']}")
        if run.error:
            log(f"error: {name} stopped early: {run.error}")
        if run.interrupted:
            break


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while files are written: the writing makes many short-lived dicts and lists
    that reference counting frees, and a full collection they set off walks every record the run kept
    (docs/host-path.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """What is alive on entry (imported modules, the model, the trace) leaves the cyclic collector's
    generations until the run is written, as vLLM freezes its heap after start-up (``freeze_gc_heap``), so
    that a collection during a measured step does not walk it (docs/host-path.md). On exit everything goes back
    to the collector, so that a later run in this process (a suite's) frees what this one left."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
