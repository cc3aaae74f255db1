"""The CUDA path's logic, run where the hardware is: on a GPU, and in split memory on the CPU.

Split memory runs the same buffers, copies and stream order as CUDA with the device's tensors in host
RAM, so every check here that does not need a GPU runs in CI. Only the ``cuda`` cases skip without one.
"""

import itertools

import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.runtime.engine import script_model
from strategies.runtime.models.llama import build_model
from strategies.runtime.request import SamplingParams
from tests.util import TINY64, make_requests, run_strategy

DEVICES = ["cpu-split", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs a CUDA GPU"))]


def specs():
    return [(list(range(1 + i, 30 + 3 * i)), 20, SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i,
                                                                 ignore_eos=True)) for i in range(12)]


def run_on(device, name):
    dev = "cpu" if device == "cpu-split" else "cuda"
    model = script_model(build_model(TINY64, dev))
    cfg = ExecutorConfig(max_batch_size=6, max_seq_len=128, device=dev, device_memory="split")
    reqs = make_requests(specs())
    return run_strategy(name, TINY64, model, cfg, reqs, keep_open=True), reqs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["static", "inflight", "overlap"])
def test_device_tokens_equal_shared_cpu_tokens(device, name):
    ref = make_requests(specs())
    run_strategy(name, TINY64, script_model(build_model(TINY64)), ExecutorConfig(max_batch_size=6, max_seq_len=128),
                 ref)
    s, reqs = run_on(device, name)
    try:
        assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]
        # The engine's own staging buffers: pinned on CUDA; on either, distinct from the device's.
        for bufs in s.engine.buffer_sets:
            for m in (bufs.runtime.tokens, bufs.step.out):
                assert m.dev.data_ptr() != m.host.data_ptr()
                assert m.host.is_pinned() == (device == "cuda")
        # Device times on the run clock: ordered, and inside the run (the clock starts after the build).
        recs = s.records
        assert all(r.forward_start_s <= r.forward_end_s <= r.sample_start_s <= r.sample_end_s for r in recs)
        assert all(b.forward_start_s >= a.sample_end_s for a, b in itertools.pairwise(recs))
        assert recs[0].forward_start_s >= recs[0].launch_s - 1e-3 and recs[0].forward_start_s >= 0
    finally:
        s.close()
