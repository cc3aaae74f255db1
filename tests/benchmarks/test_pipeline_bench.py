"""Pipeline parallelism on `small`'s shape at twice its width (hidden 512), two stages of one torch thread
each: M = 2 micro-batches against M = 1, at saturation (every request present at the start). Reports each
run's output throughput and pipeline bubble fraction, and their ratio, in ``extra_info`` and on stdout.

Why wider than `small`: with M = 2 the host prepares micro-batch k + 1 while both stages compute, so three
processes share two cores: instrumented once, a stage then took 4.1-4.4 ms (about one scheduler tick) to
receive a message's second part after its first. At `small`'s width a stage step is ~2 ms, so those waits
ate the overlap (bubble 0.46-0.54 with
M = 2 against 0.52 with M = 1, on a 6.18 kernel); at hidden 512 a step is long enough that the overlap
shows (0.36-0.41 against 0.50). The stand-in's contention, not the schedule, was being measured.

With one micro-batch a stage waits while the other computes (bubble ~ 1 - 1/N); with two, stage 0
computes micro-batch k+1 while stage 1 computes k. Equal resources: the same two stage processes of one
thread each, the same 64 slots and KV, the same requests (M = 2 splits the slots, 32 rows a micro-batch).
The bound is on the bubble only: on a 2-core machine the host process competes with two busy stages for
the cores, so the throughput ratio is reported, not bounded (measured: docs/buffers.md)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from harness.metrics import pipeline_bubble_fraction
from harness.output.records import iterations_frame
from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.models.config import PRESETS
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from tests.util import ListSource

SMALL = replace(PRESETS["small"], hidden_size=512, intermediate_size=1376)  # small's shape, twice as wide
pytestmark = pytest.mark.serial  # timings: run alone, after the parallel part


def _run(model, micro_batches: int) -> tuple[float, float]:
    cfg = ExecutorConfig(max_batch_size=64, max_seq_len=256, max_num_tokens=2048, pipeline_stages=2,
                         num_micro_batches=micro_batches, device_threads=1)
    rng = np.random.default_rng(0)
    requests = [Request(f"r{i}", rng.integers(0, SMALL.vocab_size, size=64), 32, SamplingParams(ignore_eos=True))
                for i in range(96)]
    s = get_strategy("pipeline")(SMALL, model, cfg)
    try:
        s.run(ListSource(requests))
    finally:
        s.close()
    first = min(r.forward_start_s for r in s.records)
    last = max(r.sample_end_s for r in s.records)
    tokens = sum(r.num_output_tokens for r in requests)
    return tokens / (last - first), pipeline_bubble_fraction(iterations_frame(s.records))


def test_two_micro_batches_fill_the_pipeline(benchmark):
    model = script_model(build_model(SMALL))
    (tput1, bubble1), (tput2, bubble2) = _run(model, 1), _run(model, 2)
    benchmark.extra_info.update(tokens_per_s_m1=tput1, tokens_per_s_m2=tput2, throughput_ratio=tput2 / tput1,
                                bubble_m1=bubble1, bubble_m2=bubble2)
    print(f"\nsmall at hidden 512, 2 stages x 1 thread: M=1 {tput1:,.0f} tok/s (bubble {bubble1:.2f}); "
          f"M=2 {tput2:,.0f} tok/s (bubble {bubble2:.2f}); ratio {tput2 / tput1:.2f}")
    benchmark(lambda: None)
    assert bubble2 < bubble1
