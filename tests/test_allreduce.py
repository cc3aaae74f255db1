"""Tensor parallelism's all-reduce as vLLM picks and runs it on Hopper (sim/published/allreduce.py), checked against
what vLLM's source says and what its and SGLang's published kernel benchmarks measured — not against serving runs."""

from dataclasses import replace

import pytest

from strategies.runtime.batch import BatchWork
from strategies.runtime.sim.cost import CostModel
from strategies.runtime.sim.profile import DeviceProfile
from strategies.runtime.sim.published.allreduce import MIB, implementation, vllm_allreduce_s
from strategies.runtime.sim.specs import MODEL_SPECS

H100 = DeviceProfile.for_gpu("h100")
SPEC = MODEL_SPECS["codellama-34b"]
NCCL = 1.0  # a price no vLLM kernel line gives: where it comes back, NCCL's price was used


def test_the_implementation_follows_vllms_thresholds_on_hopper():
    """vLLM 0.15, all_reduce_utils.py: custom all-reduce under min(8 MiB, CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"][tp])
    (8 MiB at 2 and 4, 512 KiB at 6, 256 KiB at 8; strictly less), one-stage at TP 2 always, under 512 KiB at TP 4
    and 6, under 256 KiB at 8 (csrc/custom_all_reduce.cuh); torch symmetric memory for bf16 under 64 / 32 / 64 / 64
    MiB; NCCL above, and for fp16 past custom all-reduce."""
    assert implementation(8 * MIB - 16, 2, True) == "one_stage"
    assert implementation(8 * MIB, 2, True) == "two_shot"
    assert implementation(8 * MIB, 2, False) == "nccl"
    assert implementation(64 * MIB, 2, True) == "nccl"
    assert implementation(512 * 1024 - 16, 4, True) == "one_stage"
    assert implementation(512 * 1024, 4, True) == "two_stage"
    assert implementation(8 * MIB, 4, True) == "multimem"
    assert implementation(32 * MIB, 4, True) == "nccl"
    assert implementation(256 * 1024 - 16, 8, True) == "one_stage"
    assert implementation(256 * 1024, 8, True) == "multimem"
    assert implementation(512 * 1024, 6, True) == "multimem"
    # CodeLlama-34B at TP 2 (16 KiB a token): custom all-reduce up to 511 tokens, symmetric memory from 512
    assert implementation(511 * 16384, 2, True) == "one_stage" and implementation(512 * 16384, 2, True) == "two_shot"


@pytest.mark.parametrize("tp, mib, us, tolerance", [
    (2, 0.5, 7.0, 0.01),  # vLLM PR 24111, CUDA graph
    (2, 1, 12.9 - 3.5, 0.15), (2, 4, 26.6 - 3.5, 0.1),  # SGLang PR 2904, eager: less its ~3.5 us copy and launch
    (4, 0.5 - 1 / 1024, 10, 0.1),  # one-stage, PR 24111 (graph)
    (4, 1, 18, 0.15), (4, 4, 43, 0.1),  # two-stage, PR 24111
    (8, 0.125, 11.8, 0.15),  # SGLang PR 2904, eager
])
def test_prices_meet_the_published_measurements(tp, mib, us, tolerance):
    got = vllm_allreduce_s(mib * MIB, tp, True, NCCL) * 1e6
    assert got < NCCL * 1e6 and got == pytest.approx(us, rel=tolerance)


def test_what_nothing_published_covers_is_nccls_price():
    """Symmetric memory's two-shot at TP 2 (8-64 MiB) has no published H100 figure: it costs what NCCL does."""
    assert vllm_allreduce_s(16 * MIB, 2, True, NCCL) == NCCL


def test_a_tp2_decode_step_pays_custom_all_reduce_not_nccls_latency():
    """CodeLlama-34B, TP 2, 30 decode rows: 97 all-reduces of 480 KiB (two a layer and the embedding's) at ~7 us each
    under vLLM's custom kernel (PR 24111: 7 us at 512 KiB), where NCCL's fitted latency alone is 38 us."""
    w = BatchWork(tokens=30, samples=30, kv_read_tokens=30 * 700, attention_pairs=30 * 700)
    vllm = CostModel(SPEC, H100, tp=2).phases(w)["communication"]
    assert 97 * 6.5e-6 < vllm < 97 * 8e-6 + 40e-6  # and one gather of the logits
    nccl = CostModel(SPEC, replace(H100, allreduce="nccl"), tp=2).phases(w)["communication"]
    assert nccl > 97 * 38e-6
