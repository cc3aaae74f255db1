"""Tensor parallelism's all-reduce as vLLM runs it on Hopper GPUs: which implementation takes a message of a given
size, and what each costs, from published kernel measurements.

vLLM (v0.15, ``distributed/device_communicators/cuda_communicator.py``: ``CudaCommunicator.all_reduce``) tries, in
order: NCCL's symmetric memory (off by default: ``VLLM_USE_NCCL_SYMM_MEM=0``), quick all-reduce (ROCm only), its own
custom all-reduce, torch symmetric memory (``VLLM_ALLREDUCE_USE_SYMM_MEM=1`` by default; bf16 only), then NCCL. On
compute capability 9.0 (``all_reduce_utils.py``):

- custom all-reduce takes messages under min(8 MiB, ``CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"][tp]``): 8 MiB at TP 2 and 4,
  512 KiB at 6, 256 KiB at 8. Its kernel (``csrc/custom_all_reduce.cuh``) is one-stage at TP 2 always, at TP 4 and 6
  under 512 KiB, at TP 8 under 256 KiB; two-stage (reduce-scatter + all-gather) above;
- torch symmetric memory takes what is left under ``SYMM_MEM_ALL_REDUCE_MAX_SIZES["9.0"][tp]`` (64 MiB at TP 2, 32 at
  4, 64 at 6 and 8), bf16 only: two-shot at TP 2, NVSwitch multicast (multimem) at 4 and more;
- NCCL takes the rest (and symmetric memory's share in fp16).

All of them are captured in vLLM's CUDA graphs (``graph_capture`` registers the custom kernel's buffers), so a
step pays the kernel, not its launch. Each forward all-reduces twice a layer (attention's and the MLP's outputs)
and once after the vocabulary-parallel embedding; the logits are all-gathered once (NCCL, outside the graph).

Prices: a line, latency + bytes × µs per MiB, fitted (least squares, below, at import) to the published H100 SXM
points of each implementation; NCCL's price is the device profile's (its fit to Vidur's DGX table). No serving run
set any of them.
"""

from __future__ import annotations

from functools import cache

import numpy as np

MIB = 1 << 20
CUSTOM_MAX = {2: 8 * MIB, 4: 8 * MIB, 6: 512 * 1024, 8: 256 * 1024}  # custom all-reduce's limit by TP degree
ONE_STAGE_MAX = {2: float("inf"), 4: 512 * 1024, 6: 512 * 1024, 8: 256 * 1024}  # its one-stage kernel's
SYMM_MEM_MAX = {2: 64 * MIB, 4: 32 * MIB, 6: 64 * MIB, 8: 64 * MIB}
HOPPER = ("h100", "h200")

# Published H100 SXM measurements, (MiB, µs) of one all-reduce of bf16 at hidden 8192, by (implementation, TP):
# - vLLM PR 24111 (benchmarks/kernels/benchmark_device_communicators.py, CUDA graphs): TP 2 custom one-stage 7 µs
#   at 0.5 MiB (the table's one row the public copy keeps); TP 4 and TP 6, every backend, 0.5-4 MiB.
# - SGLang PR 2904 (vLLM's custom all-reduce, eager: the copy into its IPC buffer and the launch included): TP 2
#   12.9, 17.7, 26.6 µs at 1, 2, 4 MiB; TP 8 10.1, 9.3, 11.8 µs at 8 KiB, 64 KiB, 512 KiB of fp32 (2K-128K elements).
POINTS: dict[tuple[str, int], list[tuple[float, float]]] = {
    ("one_stage", 4): [(0.5, 10), (1, 15), (1.5, 19), (2, 22), (3, 30), (4, 38)],
    ("two_stage", 4): [(0.5, 17), (1, 18), (1.5, 27), (2, 27), (3, 35), (4, 43)],
    ("multimem", 4): [(0.5, 16), (1, 18), (1.5, 21), (2, 23), (3, 28), (4, 33)],
    ("one_stage", 6): [(0.5, 13), (1, 21), (1.5, 30), (2, 38), (3, 53), (4, 70)],
    ("two_stage", 6): [(0.5, 15), (1, 17), (1.5, 20), (2, 26), (3, 29), (4, 37)],
    ("multimem", 6): [(0.5, 13), (1, 16), (1.5, 18), (2, 21), (3, 25), (4, 31)],
    ("one_stage", 8): [(8 / 1024, 10.1), (64 / 1024, 9.3), (0.5, 11.8)],  # eager (SGLang): no graph figure published
}
TP2_GRAPH_POINT = (0.5, 7.0)  # MiB, µs: PR 24111, TP 2, custom one-stage under a CUDA graph
TP2_EAGER_SLOPE_POINTS = [(1, 12.9), (2, 17.7), (4, 26.6)]  # SGLang PR 2904, TP 2: the cost of a MiB more
# TP 8's multicast is priced with TP 6's points: multimem's time hardly depends on the GPU count (one NVSwitch
# reduction), and no TP 8 figure of vLLM's release was published


@cache
def line(kind: str, tp: int) -> tuple[float, float] | None:
    """(latency s, seconds per byte) of implementation ``kind`` at ``tp`` GPUs, or None where nothing was measured."""
    if (kind, tp) == ("one_stage", 2):  # the graph point, with the slope the eager points give past 1 MiB
        slope = float(np.polyfit(*zip(*TP2_EAGER_SLOPE_POINTS, strict=True), 1)[0])
        mib, us = TP2_GRAPH_POINT
        return (us - slope * mib) * 1e-6, slope * 1e-6 / MIB
    key = ("multimem", 6) if (kind, tp) == ("multimem", 8) else (kind, tp)
    if key not in POINTS:
        return None
    slope, intercept = np.polyfit(*zip(*POINTS[key], strict=True), 1)
    return max(float(intercept), 0.0) * 1e-6, float(slope) * 1e-6 / MIB


def implementation(nbytes: float, tp: int, bf16: bool) -> str:
    """Which of vLLM's all-reduces takes a message of ``nbytes`` over ``tp`` Hopper GPUs (module docstring)."""
    if nbytes < CUSTOM_MAX.get(tp, 0):
        return "one_stage" if nbytes < ONE_STAGE_MAX[tp] else "two_stage"
    if bf16 and nbytes < SYMM_MEM_MAX.get(tp, 0):  # torch symmetric memory takes bf16 only
        return "two_shot" if tp == 2 else "multimem"
    return "nccl"


def vllm_allreduce_s(nbytes: float, tp: int, bf16: bool, nccl_s: float) -> float:
    """One all-reduce of ``nbytes`` over ``tp`` Hopper GPUs as vLLM runs it; ``nccl_s``: NCCL's price of it (the
    device profile's), which also prices what no published figure covers (symmetric memory's two-shot at TP 2)."""
    kind = implementation(nbytes, tp, bf16)
    fit = None if kind == "nccl" else line(kind, tp)
    if fit is None:
        return nccl_s
    latency, per_byte = fit
    return latency + per_byte * nbytes
