"""A served engine: one strategy's own loop on a thread of its own in the engine's process (``engine_process.py``),
fed by the HTTP front end's requests (``LiveSource``), and what it served kept for the run directory written at
shutdown — the same files as ``slotbench run``, each request's arrival the moment it reached the server. What has
ended is written away as the server goes (``spool.py``): it holds the requests that run, and at most ``CHUNK`` that
ended, never every one it served."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from harness.app import staging_dir, write_run
from harness.context_length import resolve_max_seq_len
from harness.measure import Measured
from harness.options import RunOptions
from harness.plan import Plan, check_draft_model, load_model, resolve_executor, warm_request
from harness.runner import StrategyRun, build_requests, executor_class, warm_up
from harness.serve.live_source import LiveSource, ServerClosing
from harness.serve.spool import CHUNK, Spool
from harness.traces.trace import Trace, TraceRequest
from strategies.interface import Executor, make_clock
from strategies.runtime.request import Request, Status


class ServedEngine:
    def __init__(self, opts: RunOptions, notify: Callable[[], None], spool_dir: Path) -> None:
        if opts.device == "sim":  # the HTTP path is real here: no modelled serving path on top of it
            opts = dataclasses.replace(opts, serving_path="none")
        self.name = opts.strategies[0]
        self.model_cfg, model = load_model(opts)
        self.opts = opts = resolve_max_seq_len(opts, self.model_cfg)
        check_draft_model(opts, self.model_cfg)
        self.executor, self.sim_info = resolve_executor(opts, self.model_cfg)
        cls = executor_class(self.name, self.executor)
        if opts.warmup:  # (as `slotbench run` warms up, with requests of the options' lengths)
            warm = [warm_request(TraceRequest(0.0, opts.input_len, opts.output_len), opts.max_seq_len)]
            warm_up(cls, self.model_cfg, model, self.executor,
                    build_requests(warm * opts.warmup, opts.sampling_defaults(), self.model_cfg.vocab_size,
                                   opts.seed + 1, "warmup-"))
        self.clock = make_clock(self.executor)
        self.strategy: Executor = cls(self.model_cfg, model, self.executor, self.clock)
        self.source = LiveSource(self.clock, self.executor.device == "sim", notify)
        self.source.executor = self.strategy
        self.source.between_steps = self._write_away
        self.notify = notify
        # the requests the front end handed in that are running, or ended since the last part was written away
        self.requests: list[Request] = []
        self._lock = threading.Lock()  # ``requests`` is appended on the front end's thread
        self._spooled_at = 0  # ``source.ended`` when the last part was written away
        self.spool = Spool(spool_dir)
        self.error: str | None = None  # why the engine stopped before the shutdown, if it did
        self.wall_s = 0.0
        self._thread = threading.Thread(target=self._serve, name="slotbench-engine", daemon=True)

    def start(self) -> None:
        self.source.start()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        """Until the engine's loop has stopped (a fault, or ``stop``)."""
        self._thread.join()

    def submit(self, r: Request) -> None:
        """Hand ``r`` to the engine (its arrival: now). Raises ``ServerClosing`` after ``stop``."""
        with self._lock:
            self.source.submit(r)
            self.requests.append(r)

    def _write_away(self) -> None:
        """Between steps (the engine's thread): once ``CHUNK`` requests have ended, they, the records of the steps
        that are done and the slot tenures that have ended go to the spool; the engine keeps only what runs."""
        if self.source.ended - self._spooled_at < CHUNK:
            return
        self._spooled_at = self.source.ended
        with self._lock:
            ended = [r for r in self.requests if r.status.terminal]
            self.requests = [r for r in self.requests if not r.status.terminal]
        records, tenures = self.strategy.take_history()
        self.spool.put(ended, records, tenures)

    def _serve(self) -> None:
        try:
            self.strategy.run(self.source)
        except ServerClosing:
            pass
        except Exception as exc:  # an engine fault: the requests it held fail, the front end answers 503
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.source.close()  # (after a fault: no more arrivals that would never run)
            self.wall_s = self.clock.now()
            reason = self.error or "the server shut down"
            with self._lock:
                for r in self.requests:
                    if not r.status.terminal:
                        r.end(Status.FAILED, reason, self.wall_s)
                        if r.slot is not None:
                            r.leave_slot()
            self.notify()

    def stop(self) -> StrategyRun:
        """Stop the loop (unfinished requests fail) and close the engine; what was served, as a strategy run."""
        self.source.close()
        self._thread.join()
        self.strategy.close()
        self.spooled = s = self.spool.close()
        if s.error is not None:  # (what it could not write away is in the run directory all the same)
            print(f"slotbench serve: writing away ended requests failed ({s.error}): kept them in memory",
                  file=sys.stderr)
        requests, records, tenures = s.unwritten
        return StrategyRun(self.name, [*requests, *self.requests], [*records, *self.strategy.records], self.wall_s,
                           self.error, interrupted=self.error is None,
                           tenures=[*tenures, *self.strategy.slot_tenures()], spooled=s)

    def trace(self) -> Trace:
        """The requests served, as a trace (run.json's ``trace``), in arrival order: once stopped."""
        held = [TraceRequest(r.arrival_s, r.prompt_len, r.max_new_tokens)
                for r in (*self.spooled.unwritten[0], *self.requests)]
        requests = sorted([*self.spooled.trace, *held], key=lambda t: t.arrival_s)
        return Trace(tuple(requests), "served", "http")

    def run_options(self) -> RunOptions:
        """The options a run directory records: the strategy served, its limits resolved."""
        return dataclasses.replace(self.opts, strategies=(self.name,))


def write_served(out: Path, engine: ServedEngine, run: StrategyRun) -> int:
    """The same files as ``slotbench run`` writes, for the one strategy served (the engine's process); the
    number of requests served."""
    opts = engine.run_options()
    plan = Plan(opts, engine.trace(), engine.model_cfg, None, engine.executor, engine.sim_info,
                opts.sampling_defaults(), [])
    staging = staging_dir(out)
    measured = Measured()
    measured.add(staging, run, opts)
    write_run(staging, out, plan, measured, True, lambda msg: print(msg, file=sys.stderr))
    return len(run.requests) + (len(run.spooled.requests) if run.spooled is not None else 0)
