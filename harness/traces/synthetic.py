"""Synthetic traces: seeded arrivals and lengths, as vLLM's random dataset and request-rate options.

Arrivals: ``request_rate`` requests/s with gamma inter-arrival times of shape ``burstiness`` (1.0 is
Poisson; smaller is burstier), or all at t=0 when the rate is infinite. A ramp (``vllm bench serve
--ramp-up-strategy``) draws request i's gap at the rate it reaches at progress i / (n - 1) from its start
to its end rate: linearly, or geometrically (exponential). Lengths around a mean L:
fixed; uniform in [L(1-r), L(1+r)] (vLLM's range ratio r); normal with std rL; lognormal with
sigma r; zipf with exponent ``zipf_a`` scaled so the median is about L. Prompts are random ids, after
an optional shared prefix.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from harness.errors import UserError
from harness.traces.sessions import SessionShape, as_sessions, session_turns
from harness.traces.trace import Trace, TraceRequest

LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal", "zipf")
RAMP_STRATEGIES = ("linear", "exponential")


def ramp_rates(n: int, strategy: str, start_rps: float, end_rps: float) -> np.ndarray:
    """Each request's rate on a ramp from ``start_rps`` to ``end_rps`` (vLLM's: progress i / (n - 1))."""
    if strategy not in RAMP_STRATEGIES:
        raise UserError(f"--ramp-up-strategy {strategy!r}: expected one of {', '.join(RAMP_STRATEGIES)}")
    if not 0 <= start_rps <= end_rps or end_rps == 0 or math.isinf(end_rps):
        raise UserError(f"--ramp-up-start-rps {start_rps} and --ramp-up-end-rps {end_rps}: need 0 <= start <= end, "
                        "end finite and positive")
    if strategy == "exponential" and start_rps == 0:
        raise UserError("--ramp-up-strategy exponential: --ramp-up-start-rps must be positive")
    progress = np.arange(n) / max(n - 1, 1)
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    return start_rps * (end_rps / start_rps) ** progress


def arrival_times(n: int, request_rate: float | np.ndarray, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Arrivals at ``request_rate`` (one rate, or one per request: a ramp); the first at t=0."""
    if not burstiness > 0:
        raise UserError(f"--burstiness must be positive, got {burstiness}")
    if np.ndim(request_rate):  # a ramp: request i's gap drawn at its own rate (the first is not drawn)
        rates = np.maximum(np.asarray(request_rate, dtype=float), 1e-300)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rates * burstiness))
    else:
        if not request_rate > 0:
            raise UserError(f"--request-rate must be positive (or inf), got {request_rate}")
        if math.isinf(request_rate):
            return np.zeros(n)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def lengths(n: int, mean: int, dist: str, ratio: float, rng: np.random.Generator, zipf_a: float = 2.0) -> np.ndarray:
    if mean <= 0:
        raise UserError(f"lengths must be positive, got {mean}")
    if dist not in LENGTH_DISTS:
        raise UserError(f"unknown length distribution {dist!r}; valid: {', '.join(LENGTH_DISTS)}")
    if not 0 <= ratio < 1 and dist in ("uniform", "normal"):
        raise UserError(f"--range-ratio must be in [0, 1), got {ratio}")
    if dist == "fixed" or (ratio == 0 and dist != "zipf"):
        x = np.full(n, float(mean))
    elif dist == "uniform":
        lo, hi = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
        x = rng.integers(max(lo, 1), hi + 1, size=n).astype(float)
    elif dist == "normal":
        x = rng.normal(mean, ratio * mean, size=n)
    elif dist == "lognormal":
        x = mean * rng.lognormal(0.0, ratio, size=n)
    else:
        x = mean * rng.zipf(zipf_a, size=n)  # the median of Zipf(a >= 2) is 1: median length ~ mean
    return np.maximum(np.rint(x), 1).astype(np.int64)


def synthetic_trace(num_prompts: int, input_len: int, output_len: int, *, request_rate: float = math.inf,
                    burstiness: float = 1.0, length_dist: str = "uniform", range_ratio: float = 0.0,
                    output_range_ratio: float | None = None, prefix_len: int = 0, num_prefixes: int = 1,
                    seed: int = 0, encoder_input_len: int = 0,
                    ramp: tuple[str, float, float] | None = None, sessions: SessionShape | None = None) -> Trace:
    """``prefix_len`` > 0 opens every prompt with one of ``num_prefixes`` shared prefixes (drawn per
    request) before its ``input_len`` random tokens, as ``vllm bench serve --random-prefix-len`` and
    SGLang's generated-shared-prefix dataset do. ``encoder_input_len`` > 0 gives every request an encoder
    input of that mean length (an encoder–decoder model's), drawn like the input lengths. ``ramp`` =
    (strategy, start rps, end rps) replaces ``request_rate`` with a ramp. ``sessions`` groups the
    ``num_prompts`` requests into multi-turn sessions; the rate (or the ramp) is then the sessions'."""
    if num_prompts <= 0:
        raise UserError(f"--num-prompts must be positive, got {num_prompts}")
    rng = np.random.default_rng(seed)
    turns = session_turns(num_prompts, sessions, seed) if sessions and sessions.multi_turn else None
    starts = num_prompts if turns is None else len(turns)
    rate = request_rate if ramp is None else ramp_rates(starts, *ramp)
    t = arrival_times(starts, rate, burstiness, rng)
    if turns is not None:  # every turn at its session's first arrival (sessions.py)
        t = np.repeat(t, turns)
    n_in = lengths(num_prompts, input_len, length_dist, range_ratio, rng)
    n_out = lengths(num_prompts, output_len, length_dist,
                    range_ratio if output_range_ratio is None else output_range_ratio, rng)
    if prefix_len < 0 or num_prefixes <= 0:
        raise UserError("--prefix-len must be >= 0 and --num-prefixes positive")
    if prefix_len:
        groups = rng.integers(0, num_prefixes, size=num_prompts)
        reqs = [TraceRequest(float(a), prefix_len + int(i), int(o), prefix_ids=(int(g),), prefix_block_len=prefix_len)
                for a, i, o, g in zip(t, n_in, n_out, groups, strict=True)]
    else:
        reqs = [TraceRequest(float(a), int(i), int(o)) for a, i, o in zip(t, n_in, n_out, strict=True)]
    if encoder_input_len:  # drawn after the rest, so a trace without encoder inputs is unchanged
        n_enc = lengths(num_prompts, encoder_input_len, length_dist, range_ratio, rng)
        reqs = [replace(r, encoder_tokens=int(e)) for r, e in zip(reqs, n_enc, strict=True)]
    if turns is not None:
        assert sessions is not None
        reqs = as_sessions(reqs, turns, sessions, seed)
    return Trace(tuple(reqs), source="synthetic", format="synthetic")
