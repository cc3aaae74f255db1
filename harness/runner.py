"""Run one strategy over a trace: build the requests, warm up, replay, and keep what happened.

A fault or an interrupt never loses what was measured: the run stops, requests that had not ended are
marked ``failed`` with the reason, and the caller writes everything recorded up to that point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from harness.errors import UserError
from harness.source import TraceSource
from harness.traces.prompts import PromptBuilder
from harness.traces.stage_drain import StageDrain
from harness.traces.trace import TraceRequest
from strategies.config import ExecutorConfig
from strategies.interface import Executor, make_clock
from strategies.registry import get_strategy
from strategies.runtime.buffers.slots import SlotTenure
from strategies.runtime.device.compute import compute_budget
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from harness.serve.spool import Spooled


@dataclass
class StrategyRun:
    name: str
    requests: list[Request]
    records: list[IterationRecord]
    wall_s: float
    error: str | None = None  # why the run stopped early, if it did
    interrupted: bool = False  # stopped by SIGINT
    warmup_s: float = 0.0
    torch_threads: int = 0  # torch's intra-op threads while this strategy ran (warm-up included); 0 on the
    # simulated device, which runs no torch op (and never imports torch)
    tenures: list[SlotTenure] = field(default_factory=list)  # who held which slot when (slots.parquet)
    extras: dict = field(default_factory=dict)  # what the executor adds (an endpoint client: its server's metrics)
    # a server's: what it wrote away as it went (harness/serve/spool.py), before the lists above
    spooled: Spooled | None = None


def build_requests(trace: list[TraceRequest], defaults: SamplingParams, vocab_size: int, seed: int,
                   prefix: str = "", max_seq_len: int | None = None) -> list[Request]:
    """Requests for a trace; random prompt ids are drawn from ``seed`` so every strategy sees the same.
    A request longer than ``max_seq_len`` can never be served: its prompt is not built (a trace line
    may claim any length), and the executor rejects it from its claimed size. A session's later turn is
    built with its own prompt; its history is prepended when it is sent (harness/source.py)."""
    prompts = PromptBuilder(vocab_size, seed)
    out = []
    for i, (t, rid) in enumerate(zip(trace, request_ids(trace, prefix), strict=True)):
        fits = max_seq_len is None or t.input_tokens + t.output_tokens <= max_seq_len
        prompt = prompts.prompt(t) if fits else None
        overrides = dict(t.sampling or {})
        if "stop_token_ids" in overrides:
            overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
        # A distinct stream per request, derived from the run seed: reproducible, strategy-independent.
        overrides.setdefault("seed", (seed * 1_000_003 + i) % 2**32)
        if "beam_width" in overrides and "num_return_sequences" not in overrides:  # a line's narrower beam
            overrides["num_return_sequences"] = min(defaults.num_return_sequences, overrides["beam_width"])
        try:
            sampling = replace(defaults, **overrides)
        except ValueError as exc:
            raise UserError(f"request {rid}: {exc}") from None
        encoder = prompts.encoder_prompt(t) if fits else None
        out.append(Request(rid, prompt, t.output_tokens, sampling, arrival_s=t.arrival_s,
                           num_prompt_tokens=t.input_tokens, encoder_prompt_token_ids=encoder,
                           session_id=t.session_id, turn=t.turn, turn_delay_s=t.delay_s, stage=t.stage))
    return out


def request_ids(trace: list[TraceRequest] | tuple[TraceRequest, ...], prefix: str = "") -> list[str]:
    """Each request's id: the trace line's own, or ``prefix`` + its index. Tokens and metrics are kept per
    id, so an index that is another line's id is refused (the loader already refuses a repeated given id)."""
    given = {t.request_id for t in trace if t.request_id}
    out = []
    for i, t in enumerate(trace):
        rid = t.request_id or f"{prefix}{i}"
        if not t.request_id and rid in given:
            raise UserError(f"trace request {i} has no request_id, and the one slotbench would give it, {rid!r}, is "
                            "another line's: give every line a request_id, or none")
        out.append(rid)
    return out


def run_strategy(name: str, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 requests: list[Request], *, max_concurrency: int | None = None,
                 warmup: list[Request] | None = None,
                 on_end: Callable[[Request], None] | None = None,
                 fault_at_iteration: int | None = None,
                 profile_iters: tuple[int, int] | None = None, cls: type[Executor] | None = None,
                 request_timeout_s: float | None = None, stage_drain: StageDrain | None = None) -> StrategyRun:
    """Warm up, then replay ``requests`` through strategy ``name``. Every strategy, peers included, runs
    with ``config.device_threads`` torch threads (on a device that runs torch) whatever ran before it, and
    leaves the process's thread count and switch interval as it found them. ``cls``: the executor, where it is
    not the registry's ``name`` (an endpoint client). ``request_timeout_s``, ``stage_drain``: the client's time-out and
    its rule between load stages (source.py)."""
    cls = cls or executor_class(name, config)
    budget = nullcontext(0) if config.device == "sim" else compute_budget(config.device_threads)
    with budget as threads:
        run = _run(cls, model_cfg, model, config, requests, max_concurrency, warmup, on_end, fault_at_iteration,
                   profile_iters, request_timeout_s, stage_drain)
    return replace(run, torch_threads=threads)


def executor_class(name: str, config: ExecutorConfig) -> type[Executor]:
    """The executor that runs strategy ``name``: the registry's, or N replicas of it (``--num-replicas``;
    disagg's engines are its prefill and decode workers)."""
    cls = get_strategy(name)
    if config.num_replicas > 1 and name != "disagg":
        from strategies.fleet import replicated

        cls = replicated(cls)
    return cls


def warm_up(cls: type[Executor], model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
            warmup: list[Request]) -> None:
    """``warmup`` through an executor of its own (the first steps at new shapes compile and profile), closed
    after: nothing of it is measured."""
    w = cls(model_cfg, model, config)
    try:
        w.run(TraceSource(warmup))
    finally:
        w.close()


def _run(cls: type[Executor], model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
         requests: list[Request], max_concurrency: int | None, warmup: list[Request] | None,
         on_end: Callable[[Request], None] | None, fault_at_iteration: int | None,
         profile_iters: tuple[int, int] | None, request_timeout_s: float | None = None,
         stage_drain: StageDrain | None = None) -> StrategyRun:
    warmup_s = 0.0
    t = time.perf_counter()
    try:
        if warmup:
            warm_up(cls, model_cfg, model, config, warmup)
            warmup_s = time.perf_counter() - t
        clock = make_clock(config)
        strategy = cls(model_cfg, model, config, clock)
    except Exception as exc:  # the engine failed before the run (a device process dead at start or in warm-up):
        error = f"{type(exc).__name__}: {exc}"  # nothing was measured; every request fails with the reason
        for r in requests:
            r.end(Status.FAILED, f"before the run: {error}", 0.0)
        return StrategyRun(cls.name, requests, [], 0.0, error, False, time.perf_counter() - t)
    if fault_at_iteration is not None:
        strategy.inject_fault(fault_at_iteration)
    if profile_iters is not None and config.device.startswith("cuda"):
        strategy.iteration_hook = _cuda_profiler_range(*profile_iters)
    can_abort = type(strategy).abort is not Executor.abort  # an engine without abort keeps no client time-out
    source = TraceSource(requests, max_concurrency, on_end, request_timeout_s, strategy.abort if can_abort else None,
                         stage_drain)
    error, interrupted = None, False
    clock.reset()
    try:
        strategy.run(source)
    except KeyboardInterrupt:
        error, interrupted = "interrupted (SIGINT)", True
    except Exception as exc:  # an engine fault ends this strategy's run, not the program
        error = f"{type(exc).__name__}: {exc}"
    finally:
        wall = clock.now()
        strategy.close()
    if error is not None:
        for r in requests:
            if not r.status.terminal:
                r.end(Status.FAILED, error, wall)
                r.leave_slot()
    extras = strategy.extras()
    if stage_drain is not None:
        extras["stage_starts_s"] = source.stage_origins
    return StrategyRun(cls.name, requests, strategy.records, wall, error, interrupted, warmup_s,
                       tenures=strategy.slot_tenures(), extras=extras)


def _cuda_profiler_range(first: int, last: int) -> Callable[[int], None]:
    """Brackets iterations first..last with cudaProfilerStart/Stop (nsys --capture-range=cudaProfilerApi)."""

    import torch

    def hook(iteration: int) -> None:
        if iteration == first:
            torch.cuda.profiler.start()
        elif iteration == last + 1:
            torch.cuda.profiler.stop()

    return hook
