"""Fit a production trace to a small model: start offset, limit, time and length scaling, clipping."""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.errors import UserError
from harness.traces.trace import Trace


@dataclass(frozen=True)
class Fit:
    start_offset_s: float = 0.0  # skip requests that arrive before this (trace time)
    limit: int | None = None  # keep the first N requests after the offset
    time_scale: float = 1.0  # multiply inter-arrival times and think times (0.5 replays twice as fast)
    length_scale: float = 1.0  # multiply input and output lengths
    max_input_len: int | None = None  # clip
    max_output_len: int | None = None  # clip

    def __post_init__(self) -> None:
        if self.start_offset_s < 0:
            raise UserError(f"--start-offset must be >= 0, got {self.start_offset_s}")
        if self.time_scale <= 0 or self.length_scale <= 0:
            raise UserError("--time-scale and --length-scale must be positive")
        for name in ("limit", "max_input_len", "max_output_len"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {v}")


def fit_trace(trace: Trace, fit: Fit) -> Trace:
    """A session's turns share its first arrival (harness/traces/sessions.py), so the offset keeps or drops
    a session whole; --limit may end one early, never before its turn 0."""
    reqs = [r for r in trace.requests if r.arrival_s >= fit.start_offset_s]
    if fit.limit is not None:
        reqs = reqs[: fit.limit]
    if not reqs:
        raise UserError(f"{trace.source}: no requests left after --start-offset {fit.start_offset_s}")
    # a trace's clock starts at its first arrival; a load generator's stages keep theirs (a stage's first request
    # comes a gap after its start, and its bounds and drain are on that clock; such traces are never offset)
    t0 = 0.0 if trace.stages else reqs[0].arrival_s
    out = []
    for r in reqs:
        n_in = max(1, round(r.input_tokens * fit.length_scale))
        n_out = max(1, round(r.output_tokens * fit.length_scale))
        prompt = r.prompt_token_ids
        if fit.max_input_len is not None:
            n_in = min(n_in, fit.max_input_len)
        if fit.max_output_len is not None:
            n_out = min(n_out, fit.max_output_len)
        if prompt is not None:  # explicit prompts are clipped, never stretched
            n_in = min(n_in, len(prompt))
            prompt = prompt[:n_in]
        # A prefix block scales with the lengths, so a scaled prompt keeps the trace's sharing structure.
        block = max(1, round(r.prefix_block_len * fit.length_scale)) if r.prefix_ids else r.prefix_block_len
        out.append(replace(r, arrival_s=(r.arrival_s - t0) * fit.time_scale, input_tokens=n_in, output_tokens=n_out,
                           prompt_token_ids=prompt, prefix_block_len=block, delay_s=r.delay_s * fit.time_scale))
    return trace.with_requests(out)
