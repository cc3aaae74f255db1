"""The decode step with beams (K = 4) on `small`, against the same rows without beams.

Three timings in one session, interleaved: (a) 8 beam requests x 4 beams = 32 rows, each position's KV
read through the cache indirection; (b) 32 greedy requests at the same positions (no indirection: an
engine built without beam rows); (c) the KV a copy-on-reorder design would move per step (HF's
``reorder_cache``: every beam's whole history gathered from its parent and written back, all layers) —
the cost the indirection exists to avoid. The bound: (a) <= 1.5 x (b). ``extra_info`` keeps the ratios.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.models.config import PRESETS
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from tests.benchmarks.test_micro import interleaved

SMALL = PRESETS["small"]
pytestmark = pytest.mark.serial  # timings: run alone, after the parallel part
ROWS, K, NEW = 32, 4, 64


def _engine(width: int):
    """A strategy whose engine holds ROWS decode rows: ROWS / width requests of ``width`` beams each,
    prompts 128..190 tokens, admitted (decoder state reset on the device by the first step)."""
    # the device as a thread: the copying reorder below is timed on the engine's own KV pools, in this process
    cfg = ExecutorConfig(max_batch_size=ROWS, max_seq_len=512, max_beam_width=width, cpu_device="thread")
    s = get_strategy("inflight")(SMALL, script_model(build_model(SMALL)), cfg)
    reqs = [Request(f"r{i}", np.arange(128 + 2 * i * width) % 4000, NEW, SamplingParams(beam_width=width))
            for i in range(ROWS // width)]
    for r in reqs:
        s.scheduler.admit(r, [], r.prompt_len + NEW)
    return s, reqs


def _stepper(s, reqs):
    bufs = s.engine.buffer_sets[0]
    state = {"i": 0}

    def step() -> None:
        i = state["i"]
        for r in reqs:  # the host's count of launched steps bounds the device's beam buffers
            r.pending_samples = i + 1
        batch = ScheduledBatch(i, gen_requests=list(reqs), gen_positions=[r.prompt_len + 30 for r in reqs],
                               admitted=reqs if i == 0 else [])
        s.engine.prepare(batch, bufs, s.kv.tables)
        s.stream.wait(s.engine.launch(i, bufs))
        state["i"] = (i + 1) % (NEW - 1) or 1  # never admit again; stay below max_new
    return step


def test_beam_decode_step(benchmark):
    beams, beam_reqs = _engine(K)
    greedy, greedy_reqs = _engine(1)
    try:
        step_beams, step_greedy = _stepper(beams, beam_reqs), _stepper(greedy, greedy_reqs)
        t_beam, t_greedy = interleaved(step_beams, step_greedy, rounds=30)
        k_pool, v_pool = beams.engine._k, beams.engine._v  # [L, Hkv, pages, D]
        ctx = beam_reqs[0].prompt_len + 30
        pages = torch.arange(ROWS * ctx) % k_pool.size(2)  # every beam's history, as a copying reorder moves it
        parents = pages.flip(0)

        def copy_reorder() -> None:
            with torch.inference_mode():
                k_pool.index_copy_(2, pages, k_pool.index_select(2, parents))
                v_pool.index_copy_(2, pages, v_pool.index_select(2, parents))

        t_copy, _ = interleaved(copy_reorder, step_greedy, rounds=10)
    finally:
        beams.close()
        greedy.close()
    benchmark.extra_info.update({"beam_step_ms": t_beam * 1e3, "greedy_step_ms": t_greedy * 1e3,
                                 "copy_reorder_ms": t_copy * 1e3, "beam_over_greedy": t_beam / t_greedy,
                                 "copy_over_greedy": t_copy / t_greedy})
    print(f"\nK=4 x 8 requests: {t_beam * 1e3:.2f} ms; 32 greedy requests: {t_greedy * 1e3:.2f} ms "
          f"({t_beam / t_greedy:.2f}x); copy-on-reorder KV traffic alone: {t_copy * 1e3:.2f} ms "
          f"({t_copy / t_greedy:.2f}x a step)")
    benchmark(lambda: None)
    assert t_beam <= 1.5 * t_greedy
