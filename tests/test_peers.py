"""Peer engines (transformers) through the same runner: greedy tokens equal slotbench's for every request."""

import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from harness.runner import build_requests, run_strategy
from harness.traces import synthetic_trace
from strategies.config import ExecutorConfig
from strategies.runtime.request import Status
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, tiny_models


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_peers_match_slotbench_tokens(ignore_eos):
    _, scripted = tiny_models()
    trace = synthetic_trace(24, 20, 12, request_rate=400.0, range_ratio=0.8, seed=4)
    cfg = ExecutorConfig(max_batch_size=8, max_seq_len=64, max_num_tokens=256)
    tokens = {}
    for name in ("inflight", "hf-static", "hf-cb"):
        reqs = build_requests(list(trace.requests), SamplingParams(ignore_eos=ignore_eos), TINY64.vocab_size, seed=4)
        run = run_strategy(name, TINY64, scripted, cfg, reqs)
        assert run.error is None
        assert all(r.status is Status.FINISHED for r in reqs)
        for r in reqs:  # token times come from the engine itself: increasing, after arrival
            assert len(r.token_times_s) == r.num_output_tokens
            assert r.token_times_s[0] >= r.arrival_s and np.all(np.diff(r.token_times_s) >= 0)
        tokens[name] = [r.output_token_ids for r in reqs]
    assert tokens["hf-static"] == tokens["inflight"]
    assert tokens["hf-cb"] == tokens["inflight"]
    if ignore_eos:
        assert [len(t) for t in tokens["inflight"]] == [t.output_tokens for t in trace.requests]


def test_peers_refuse_sampling():
    _, scripted = tiny_models()
    reqs = build_requests(list(synthetic_trace(3, 8, 4, seed=1).requests), SamplingParams(temperature=0.7),
                          TINY64.vocab_size, seed=1)
    run_strategy("hf-static", TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=64), reqs)
    assert all(r.status is Status.REJECTED and "greedy only" in r.finish_reason for r in reqs)


def test_every_strategy_runs_with_the_device_threads_and_restores_the_process(monkeypatch):
    """Equal compute: hf-static and hf-cb get --device-threads torch threads (observed inside their
    forwards) whatever the process had before, and every strategy puts threads and switch interval back."""
    from transformers import LlamaForCausalLM

    seen: list[int] = []
    forward = LlamaForCausalLM.forward

    def counting_forward(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counting_forward)
    _, scripted = tiny_models()
    trace = synthetic_trace(4, 12, 4, seed=2)
    old_threads, old_interval = torch.get_num_threads(), sys.getswitchinterval()
    try:
        torch.set_num_threads(2)
        sys.setswitchinterval(0.0123)
        for name in ("inflight", "hf-static", "hf-cb"):
            seen.clear()
            reqs = build_requests(list(trace.requests), SamplingParams(), TINY64.vocab_size, seed=2)
            run = run_strategy(name, TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=64), reqs)
            assert run.error is None and run.torch_threads == 1
            if name != "inflight":
                assert seen and set(seen) == {1}, (name, set(seen))
            assert torch.get_num_threads() == 2 and sys.getswitchinterval() == pytest.approx(0.0123), name
    finally:
        torch.set_num_threads(old_threads)
        sys.setswitchinterval(old_interval)
