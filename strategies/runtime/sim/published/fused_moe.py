"""A mixture-of-experts layer as vLLM runs it (v0.15, bf16, no data parallelism): its fused kernels, priced from
vLLM's own published H100 measurement.

vLLM (``model_executor/layers/fused_moe``: ``FusedMoE``, ``TritonExperts.apply``) runs a Mixtral-style MoE layer as
a handful of launches, all inside its CUDA graphs: the router's GEMM (replicated on every rank: priced as any
GEMM, not here); ``topk_softmax`` (softmax, top-k and renormalisation fused); ``moe_align_block_size`` (each
expert's tokens grouped and padded to the block size ``BLOCK_SIZE_M``); one Triton ``fused_moe_kernel`` for the
gate and up projections of *every* expert at once (w13: [E, 2 I/tp, H]); ``silu_and_mul``; a second
``fused_moe_kernel`` for the down projection (the router's weights multiplied in); ``moe_sum``; a copy into the
output. Then the layer's all-reduce: under tensor parallelism each expert is sharded over the ranks; under expert
parallelism with no data parallelism (``--ep`` = ``--tp``) each rank holds E/ep whole experts (contiguous, vLLM's
``expert_map``), computes only those, and the ranks combine with the *same* all-reduce — vLLM dispatches with an
all-to-all only when data parallelism is on (``FusedMoEParallelConfig.use_all2all_kernels``).

Work of one fused GEMM on a rank (``fused_gemm_work``): FLOPs over each expert's rows padded to ``BLOCK_SIZE_M``
(``moe_block_m``: vLLM's tuned H100 configs for E = 8), and bytes of the weights of every expert a token was routed
to, read once (the kernel's M-block grouping keeps an expert's weight strip in L2), with the rows read and written.
The layer's price is ``floor`` + the two GEMMs' roofline (the device profile's peak and bandwidth, combined as its
roofline combines them) at their own efficiencies. ``floor``, ``eff_flops`` and ``eff_bw`` are fitted (grid search,
least relative squares, at first use) to the one published table of the whole fused MoE op on H100: vLLM PR 24700
(``benchmarks/kernels/benchmark_moe.py``, Mixtral-8x7B at TP 2 with vLLM's tuned config, CUDA-graph timings: the
op without the router's GEMM and the all-reduce). No serving run set them; the MoE serving runs are held out.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from strategies.runtime.sim.profile import DeviceProfile

# vLLM's tuned config for E=8 experts on H100 (``configs/E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3.json``; the
# N=3584 and N=1792 files follow the same steps): the batch sizes it was tuned at, and BLOCK_SIZE_M at each. A
# step's config is the nearest key to its token count (``try_get_optimal_moe_config``).
TUNED_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
TUNED_BLOCK_M = (16, 16, 16, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 128, 128, 128, 128, 128)
# vLLM PR 24700 (H100 SXM, Mixtral-8x7B, TP 2: E = 8, top-2, H = 4096, I/tp = 7168, bf16): tokens → µs of the op
PR24700_US = {1: 144.03, 2: 229.28, 4: 351.10, 8: 434.98, 16: 471.49, 24: 478.27, 32: 487.35, 48: 487.85,
              64: 483.14, 96: 494.42, 128: 491.39, 256: 536.77, 512: 662.33, 1024: 833.72, 1536: 1122.93}
PR24700_SHAPE = (8, 2, 4096, 7168)  # experts, top-k, hidden, intermediate per rank
ROUTING_SEED = 0x30E


def moe_block_m(tokens: int) -> int:
    """BLOCK_SIZE_M of the tuned config nearest ``tokens`` (the first of two equally near, as ``min`` picks)."""
    i = min(range(len(TUNED_M)), key=lambda j: abs(TUNED_M[j] - tokens))
    return TUNED_BLOCK_M[i]


def expert_tokens(tokens: int, experts: int, k: int, skew: float = 0.0, seed: int = ROUTING_SEED) -> np.ndarray:
    """[E] how many of a step's ``tokens`` each expert takes: each token picks ``k`` distinct experts, expert e
    with weight (e + 1) ** -``skew`` (0: uniformly; Gumbel top-k: sampling without replacement by weight), seeded
    by the step's shape, so a step's price is a pure function of it."""
    if not tokens:
        return np.zeros(experts, dtype=np.int64)
    rng = np.random.default_rng([seed, tokens, experts, k, round(skew * 1000)])
    scores = -skew * np.log(np.arange(1, experts + 1)) + rng.gumbel(size=(tokens, experts))  # [T, E]
    chosen = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # [T, k] each token's k experts
    return np.bincount(chosen.ravel(), minlength=experts)


def fused_gemm_work(counts: np.ndarray, tokens: int, rows: int, cols: int, dtype_bytes: int) -> tuple[float, float]:
    """FLOPs and bytes of one ``fused_moe_kernel`` on a rank: its experts' token counts ``counts`` [E_rank], each
    expert's weight (rows x cols, this rank's shard), the rows padded to the BLOCK_SIZE_M of the step's ``tokens``
    (vLLM looks its config up by the step's token count, not by the rows routed)."""
    bm = moe_block_m(tokens)
    padded = int((-(-counts // bm) * bm).sum())
    hit = int((counts > 0).sum())
    return 2.0 * padded * rows * cols, (hit * rows * cols + int(counts.sum()) * (rows + cols)) * dtype_bytes


def layer_work(counts: np.ndarray, tokens: int, hidden: int, inter: int, dtype_bytes: int) -> tuple[float, float]:
    """FLOPs and bytes of the layer's two fused GEMMs (w13: H → 2 I, w2: I → H) on a rank, in a step of
    ``tokens``."""
    f1, b1 = fused_gemm_work(counts, tokens, hidden, 2 * inter, dtype_bytes)
    f2, b2 = fused_gemm_work(counts, tokens, inter, hidden, dtype_bytes)
    return f1 + f2, b1 + b2


def fused_moe_s(p: DeviceProfile, counts: np.ndarray, tokens: int, hidden: int, inter: int,
                dtype_bytes: int) -> float:
    """Seconds of one MoE layer's fused op (all but the router's GEMM and the all-reduce) on a rank: its experts'
    token counts ``counts`` in a step of ``tokens``."""
    floor, eff_flops, eff_bw = fitted(p.combine, p.ridge_k)
    flops, nbytes = layer_work(counts, tokens, hidden, inter, dtype_bytes)
    return floor + _roofline(flops / p.gpu.peak_flops / eff_flops, nbytes / p.gpu.mem_bw / eff_bw, p.combine,
                             p.ridge_k)


def _roofline(compute: np.ndarray | float, memory: np.ndarray | float, combine: str, k: float) -> np.ndarray | float:
    if combine == "max":
        return np.maximum(compute, memory)
    if combine == "sum":
        return compute + memory
    return (compute**k + memory**k) ** (1 / k)


@cache
def fitted(combine: str, ridge_k: float) -> tuple[float, float, float]:
    """(floor s, FLOP efficiency, bandwidth efficiency) that best price PR 24700's points with this way of
    combining compute and memory time, on the H100 the points were measured on (another GPU reuses them)."""
    e, k, h, i = PR24700_SHAPE
    work = np.array([layer_work(expert_tokens(t, e, k), t, h, i, 2) for t in PR24700_US])  # [P, 2]
    measured = np.array(list(PR24700_US.values())) * 1e-6  # [P]
    h100_flops, h100_bw = 989e12, 3.35e12  # the published points' card (H100 SXM)
    floors = np.linspace(0.0, 60e-6, 61)[:, None, None, None]  # [F, 1, 1, 1]
    effs_f = np.linspace(0.2, 1.0, 81)[None, :, None, None]  # [1, A, 1, 1]
    effs_b = np.linspace(0.4, 1.0, 61)[None, None, :, None]  # [1, 1, B, 1]
    model = floors + _roofline(work[:, 0] / h100_flops / effs_f, work[:, 1] / h100_bw / effs_b, combine, ridge_k)
    err = (((model - measured) / measured) ** 2).sum(axis=-1)  # [F, A, B]
    f, a, b = np.unravel_index(int(err.argmin()), err.shape)
    return float(floors[f, 0, 0, 0]), float(effs_f[0, a, 0, 0]), float(effs_b[0, 0, b, 0])
