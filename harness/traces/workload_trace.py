"""The requests of a workload (``harness/traces/workload.py``): arrivals stage after stage, prompts as the
load generator builds them, each request tagged with its stage.

inference-perf's shared-prefix generator (November 2025 to February 2026) draws random token ids over its tokenizer's
vocabulary, decodes them to text (special tokens skipped) and sends each prompt as the group's system text, a
space and the question's text; the server tokenises that text again, BOS included. Decoding random ids and
encoding the text does not give them back (Llama 2: a lone byte piece decodes to U+FFFD, which re-encodes as
three bytes; pieces merge across their joins), so the server's prompts are not system + question tokens long:
~5% longer for Llama 2's. Its random generator sends each prompt's drawn ids decoded too, special tokens kept.
Given the tokenizer (``--tokenizer``), the prompts are built exactly so, and are the ids the server computed
(decoded by the tokenizer's own decoder: transformers' ``clean_up_tokenization_spaces``, which Llama 2 sets false,
is not applied); without it they are the random ids themselves, scaled to the server's measured mean where a
measured run's file gives one.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from harness.errors import UserError
from harness.traces.stage_drain import StageDrain
from harness.traces.trace import Trace, TraceRequest
from harness.traces.workload import BOS_ID, Dist, Workload


class TextTokenizer(Protocol):
    """What the prompts need of the server's tokenizer (``harness/serve/tokenizer.py``' CheckpointTokenizer)."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def stage_arrivals(w: Workload, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times, stage index) of every request, stage after stage, each stage from its nominal start (the
    source moves a stage to the clock it starts on: ``stage_drain.py``)."""
    times, stages = [], []
    for k, ((start, end), st) in enumerate(zip(w.stage_bounds(), w.stages, strict=True)):
        n = int(st.rate * st.duration_s)
        if w.load == "constant":  # inference-perf's ConstantLoadTimer: exponential gaps scaled to the duration
            t = start + _spread(rng, n, st.rate, st.duration_s)
        else:  # its PoissonLoadTimer: a Poisson count each second, spread over that second as above
            parts, at, total = [], start, 0
            while total < n if w.multi_process else at < end:  # (the single-process loop's: while due)
                count = int(rng.poisson(st.rate))
                if count:
                    parts.append(at + _spread(rng, count, count, 1.0))
                    total += count
                at += 1.0
            t = np.concatenate(parts) if parts else np.zeros(0)
        # the multi-process loop sends rate x duration requests; the single-process one, those due before the end
        t = t[:n] if w.multi_process else t[t < end]
        times.append(t)
        stages.append(np.full(len(t), k, dtype=np.int64))
    return np.concatenate(times), np.concatenate(stages)


def _spread(rng: np.random.Generator, n: int, rate: float, duration_s: float) -> np.ndarray:
    """n send times after 0, exponential gaps at ``rate`` scaled to sum to ``duration_s`` (the last at its end)."""
    if not n:
        return np.zeros(0)
    gaps = rng.exponential(1.0 / rate, n)
    return np.cumsum(gaps * (duration_s / gaps.sum()))


def index_in_stage(stage: np.ndarray) -> np.ndarray:
    """Each request's index within its stage (the generator counts each stage's requests from 0)."""
    first = np.searchsorted(stage, stage)  # [N] (stages ascending) the stage's first request
    return np.arange(len(stage)) - first


def _scaled(d: Dist, f: float) -> Dist:
    if not d.std_dev:  # a fixed length stays fixed, rounded
        n = max(1, round(d.mean * f))
        return Dist(n, n, n)
    return Dist(d.mean * f, max(1, round(d.min * f)), max(1, round(d.max * f)), d.std_dev * f)


def shared_prefix_prompts(w: Workload, rng: np.random.Generator, vocab_size: int, target_mean: float | None,
                          tokenizer: TextTokenizer | None = None) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The N = groups x prompts-per-group distinct prompts, shuffled, and their output lengths. With ``tokenizer``
    (the server's) the generator's text tokenised as the server tokenises it; else random ids of ``vocab_size``,
    with ``target_mean`` (the server's measured prompt tokens, BOS included) the system prompt and question
    scaled by one factor so that prompts average it (module docstring)."""
    assert w.system_prompt is not None and w.question is not None
    system, question = w.system_prompt, w.question
    if target_mean is not None and tokenizer is None:
        f = (target_mean - 1) / (system.mean + question.mean)
        system, question = _scaled(system, f), _scaled(question, f)
    draw_from = tokenizer.vocab_size if tokenizer is not None else vocab_size  # (the generator's: its tokenizer's)
    prompts, outputs = [], []
    for _ in range(w.num_groups):
        prefix = rng.integers(0, draw_from, size=int(system.draw(1, rng)[0]))
        text = tokenizer.decode(prefix.tolist()) if tokenizer is not None else ""
        q_lens, o_lens = question.draw(w.prompts_per_group, rng), w.output.draw(w.prompts_per_group, rng)
        for q, o in zip(q_lens, o_lens, strict=True):
            own = rng.integers(0, draw_from, size=int(q))
            if tokenizer is not None:
                ids = tokenizer.encode(text + " " + tokenizer.decode(own.tolist()))
            else:
                ids = np.concatenate(([BOS_ID % vocab_size], prefix, own))
            prompts.append(tuple(int(x) for x in ids))
            outputs.append(int(o))
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order], np.asarray(outputs, dtype=np.int64)[order]


def _check_vocabulary(prompts: list[tuple[int, ...]], vocab_size: int) -> None:
    top = max((max(p) for p in prompts if p), default=0)
    if top >= vocab_size:
        raise UserError(f"--tokenizer: the prompts hold token id {top}, past the model's vocabulary "
                        f"({vocab_size}): give the server's model (--model; --model-spec on the simulated device)")


def workload_trace(w: Workload, path: str, seed: int, vocab_size: int, tokenizer: TextTokenizer | None = None) -> Trace:
    """``tokenizer``: the server's, for a shared-prefix or random workload's prompts (module docstring)."""
    rng = np.random.default_rng(w.seed if w.seed is not None else seed)
    arrivals, stage = stage_arrivals(w, rng)
    at = index_in_stage(stage)  # [N] request i of its stage
    sampling = {"ignore_eos": True} if w.ignore_eos else None  # one dict for every request: nothing writes to it
    n = len(arrivals)
    if w.data == "shared_prefix":
        measured = [s.prompt_tokens_mean for s in w.stages if s.prompt_tokens_mean]
        prompts, outputs = shared_prefix_prompts(w, rng, vocab_size, float(np.mean(measured)) if measured else None,
                                                 tokenizer)
        _check_vocabulary(prompts, vocab_size)
        which = (at % len(prompts)).tolist()
        reqs = [TraceRequest(float(arrivals[i]), len(prompts[j]), int(outputs[j]), prompt_token_ids=prompts[j],
                             stage=int(stage[i]), sampling=sampling) for i, j in enumerate(which)]
    else:  # random / synthetic: lengths drawn per request, or once (total_count) and taken by index in the stage
        assert w.input is not None
        inp, out = _lengths(w.input, "input", at, rng), _lengths(w.output, "output", at, rng)
        prompts: list[tuple[int, ...] | None] = [None] * n  # random ids, built by the run (seeded)
        if w.data == "random" and tokenizer is not None:
            # inference-perf's random generator: each prompt's drawn ids decoded to text (special tokens kept), which
            # the server tokenises
            built = [tuple(tokenizer.encode(tokenizer.decode(rng.integers(0, tokenizer.vocab_size, int(k)).tolist(),
                                                             skip_special_tokens=False))) for k in inp]
            _check_vocabulary(built, vocab_size)
            prompts, inp = list(built), [len(p) for p in built]
        reqs = [TraceRequest(float(arrivals[i]), int(inp[i]), int(out[i]), prompt_token_ids=prompts[i],
                             stage=int(stage[i]), sampling=sampling) for i in range(n)]
    bounds = w.stage_bounds()
    drain = StageDrain.of_loop(tuple(s for s, _ in bounds), w.interval_s, w.multi_process)
    return Trace(tuple(reqs), path, f"workload:{w.data}/{w.load}",
                 stages=tuple((s, e, st.rate) for (s, e), st in zip(bounds, w.stages, strict=True)),
                 request_timeout_s=w.request_timeout_s, max_concurrency=w.max_concurrency, stage_drain=drain)


def _lengths(d: Dist, name: str, at: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[N] lengths: drawn per request, or (``total_count``) drawn once and request i of a stage taking the i-th."""
    if d.total_count is None:
        return d.draw(len(at), rng)
    if len(at) and at.max() >= d.total_count:
        raise UserError(f"workload config: data.{name}_distribution.total_count {d.total_count} is fewer than a "
                        f"stage's {int(at.max()) + 1} requests (inference-perf's random generator would run out)")
    return d.draw(d.total_count, rng)[at]
