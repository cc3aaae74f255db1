"""A GPU's device profile: the efficiencies and latencies that turn a kernel's work into seconds.

Datasheet defaults per GPU (``DeviceProfile.for_gpu``), or fitted: to a real run (``slotbench calibrate
RUN_DIR``) or to published per-operator kernel tables (``slotbench calibrate --op-profile``), which also
keep the measured GEMMs (``gemm_table.py``). Every GEMM and element-wise kernel is priced here, by the
simulator and by the fit alike, so what is fitted is what a simulated step sums.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from strategies.runtime.sim.gemm_table import GemmTable, gemm_key, measured_at, validate_table
from strategies.runtime.sim.kernels import gemm_work, ring_allreduce_bytes
from strategies.runtime.sim.published.allreduce import vllm_allreduce_s
from strategies.runtime.sim.specs import GPUS, GpuSpec

# Achieved / peak bandwidth of each element-wise kernel and of the embedding gather, and each one's latency
# floor. They differ by 5x on one GPU (a residual add streams; an RMSNorm reduces in float32, block by
# block; a gather is scattered). These defaults were read off the H100 tables in ../shared/profiles, so
# they are in-sample there; on A100 tables they are not (docs/simulator.md has both).
ELEM_EFF_DEFAULTS = {"input_layernorm": 0.45, "post_attention_layernorm": 0.45, "attn_rope": 0.5, "mlp_act": 0.55,
                     "add": 1.0, "emb": 0.2}
ELEM_KERNEL_S_DEFAULTS = {"input_layernorm": 2.5e-6, "post_attention_layernorm": 2.5e-6, "attn_rope": 1.5e-6,
                          "mlp_act": 1.5e-6, "add": 1e-6, "emb": 2.5e-6}
# What a byte costs beyond the part of the L2 cache a kernel's working set keeps (the previous kernel's
# output is read back from L2 while it fits): on the H100 a norm's time per token grows ~40% once its
# bytes pass ~half the 50 MB. Fitted per kernel from a table; the datasheet keeps 0, as the efficiencies
# of the L2 regime do not carry across GPUs (an A40's small norms run at 1.3x its DRAM peak, an H100's 0.5x).
ELEM_SPILL_DEFAULTS = dict.fromkeys(ELEM_EFF_DEFAULTS, 0.0)
L2_RESIDENT = 0.5  # the fraction of L2 a kernel's working set keeps (fitted: H100 and A100 tables agree)
# GEMMs on Hopper (H100, H200: the same SMs and cuBLAS kernels): the roofline `calibrate --op-profile` fits to
# the H100 table in ../shared/profiles (every GEMM of Llama-2-7B's layers, 1-4,096 tokens, TP 1-8; median
# error 5.9% where the generic defaults below give 9.1%). A decode step's weight streaming runs at ~0.97 of
# peak bandwidth there, not 0.8: at batch 8-16 the generic defaults priced Llama-2-7B's GEMMs 0.3-0.5 ms
# (~7%) above what cuBLAS measured. In-sample on H100 for these shapes, as the element-wise defaults are.
HOPPER_GEMMS = {"eff_flops": 0.758, "eff_bw": 0.97, "gemm_kernel_s": 6.7e-6, "ridge_k": 1.5}
# Prefill attention on Hopper: FlashAttention-3's varlen kernel (vLLM's and SGLang's on H100) skips the
# masked key blocks and runs at 76% of peak FLOP/s with every SM busy; `scripts/refit --only attention-h100`
# fits that to the H100 table inference-sim publishes (InferSim's fa3_mha_prefill.py: cold prompts of 4,096-32,768
# tokens, six head shapes; its 1,024-token rows carry its host timer's ~20 us and are left out). Prompts that
# long fill every round but the last, so the table cannot tell a single block's rate or fixed cost: a block may
# draw its SM's whole share, and pays the decode block's fixed cost. Decode keeps the A100 fit (docs/simulator.md
# has it against the same repository's H100 FlashInfer decode table).
HOPPER_ATTENTION = {"prefill_causal": True, "attn_eff_flops": 0.761, "prefill_block_flops": 1.0,
                    "prefill_block_s": 4.7e-6}
HOPPER = ("h100", "h200")


def spilled_bytes(nbytes: float, spill: float, l2_bytes: float) -> float:
    """``nbytes`` as priced at DRAM bandwidth: the share beyond L2_RESIDENT of the L2 costs 1 + ``spill``."""
    if not spill or not l2_bytes or nbytes <= L2_RESIDENT * l2_bytes:
        return nbytes
    return nbytes + spill * (nbytes - L2_RESIDENT * l2_bytes)


@dataclass(frozen=True)
class DeviceProfile:
    gpu: GpuSpec
    eff_flops: float = 0.7  # GEMMs (linear, LM head): achieved / peak FLOP/s
    eff_bw: float = 0.8  # GEMMs' weight streaming and attention's KV: achieved / peak bandwidth
    gemm_kernel_s: float = 4e-6  # latency floor of one GEMM
    # Attention, as thread blocks in rounds over the SMs (sim/attention.py; fitted to Vidur's A100
    # FlashAttention-2 table, so in-sample on A100 and assumed elsewhere, but Hopper's prefill:
    # HOPPER_ATTENTION). Without SMs (a CPU), and for an encoder's attention, a roofline of attn_eff_flops
    # and eff_bw.
    attn_eff_flops: float = 0.34  # prefill: achieved / peak FLOP/s with every SM busy
    prefill_block_flops: float = 0.49  # prefill: one thread block's FLOP/s / an SM's share of the peak
    prefill_block_s: float = 46e-6  # prefill: one thread block's fixed cost
    # prefill: whether a query tile reads only the keys its causal mask leaves (FlashAttention-3 on Hopper skips
    # the masked key blocks); else every tile of a chunk costs its last one (the A100 table's kernel: a cold
    # 3,456-token prompt runs at half the rate, per causal FLOP, of a 1,024-token chunk after 3,072 cached)
    prefill_causal: bool = False
    attn_eff_bw: float = 0.97  # decode: achieved / peak bandwidth with every SM busy
    attn_block_bw: float = 0.65  # decode: one thread block's bandwidth / an SM's share of the peak
    attn_block_s: float = 4.7e-6  # decode: one thread block's fixed cost (set-up, softmax, write-out)
    attn_kernel_s: float = 2e-6  # the attention kernel's launch floor (fitted to FlashInfer's decode: ~15 us)
    # per element-wise kernel (and "emb"): achieved / peak bandwidth; a single number sets them all
    elem_eff_bw: dict[str, float] = field(default_factory=lambda: dict(ELEM_EFF_DEFAULTS))
    kernel_s: float = 2e-6  # latency floor of every other kernel (~8 a layer): what small-batch decode pays
    # per element-wise kernel (and "emb"): its own latency floor (a norm's block-wide reduction costs
    # it more than twice an add's); None: kernel_s for each
    elem_kernel_s: dict[str, float] | None = field(default_factory=lambda: dict(ELEM_KERNEL_S_DEFAULTS))
    # per element-wise kernel (and "emb"): extra cost of a byte past the L2 (ELEM_SPILL_DEFAULTS)
    elem_spill: dict[str, float] = field(default_factory=lambda: dict(ELEM_SPILL_DEFAULTS))
    overhead_s: float = 30e-6  # per step: launches, synchronisation
    row_overhead_s: float = 0.0  # per sampled row: what FLOPs and bytes miss (small-batch GEMMs on a CPU)
    # One all-reduce: latency + ring bytes / (link bandwidth x link_eff). Read off the H100 DGX table (median
    # error 7.9%; 30 us and 0.7 gave 11.2%), choosing among the fits those that leave the A100 table (not
    # otherwise used) no worse (24.9%, was 25.1%: NCCL on A100 runs at 0.57 of its link, on H100 0.78).
    allreduce_latency_s: float = 38e-6
    link_eff: float = 0.775
    # where fitted, per number of GPUs ("2", "4", "8"): [latency s, link efficiency] of their all-reduce, as
    # NCCL picks its algorithm by communicator size (H100 DGX: 18 us on 2 GPUs, 30 us on 8); other counts
    # use the two above
    allreduce_by_workers: dict[str, list[float]] | None = None
    # Which all-reduce tensor parallelism runs: "vllm", vLLM's choice by message size (its custom kernels,
    # symmetric memory, NCCL: sim/published/allreduce.py), priced from published measurements where there are some
    # (Hopper); "nccl", NCCL's alone (the two fields above), as a run with vLLM's custom all-reduce disabled, or
    # another engine
    allreduce: str = "vllm"
    launch_latency_s: float = 0.0  # from launch (or the previous step's end) to the device starting
    sync_latency_s: float = 0.0  # from the device finishing to a waiting host seeing it
    # "max": within a kernel, compute and memory traffic overlap (a GPU roofline); "sum": they do not
    # (what calibration finds on a CPU, where small-batch GEMMs lose efficiency a max() cannot express);
    # "smooth": (compute^k + memory^k)^(1/k), between the two near the ridge, as measured GEMMs are.
    combine: str = "smooth"  # measured GEMMs near the ridge are slower than max() (H100 and A100 tables)
    ridge_k: float = 2.0  # the exponent of "smooth"
    # Measured GEMM times by shape (sim/gemm_table.py), kept by a fit to kernel tables: a GEMM of a shape
    # they measured costs what the next token count they measured did; any other shape (or None): the roofline
    gemm_table: GemmTable | None = None
    source: str = "datasheet"  # or what it was fitted to

    def __post_init__(self) -> None:
        if isinstance(self.elem_eff_bw, int | float):
            object.__setattr__(self, "elem_eff_bw", dict.fromkeys(ELEM_EFF_DEFAULTS, float(self.elem_eff_bw)))
        elif set(self.elem_eff_bw) != set(ELEM_EFF_DEFAULTS):
            raise ValueError(f"device profile: elem_eff_bw needs {sorted(ELEM_EFF_DEFAULTS)}")
        if self.elem_kernel_s is not None and set(self.elem_kernel_s) != set(ELEM_EFF_DEFAULTS):
            raise ValueError(f"device profile: elem_kernel_s needs {sorted(ELEM_EFF_DEFAULTS)}")
        if set(self.elem_spill) != set(ELEM_EFF_DEFAULTS) or min(self.elem_spill.values()) < 0:
            raise ValueError(f"device profile: elem_spill needs {sorted(ELEM_EFF_DEFAULTS)}, each >= 0")
        by_workers = list((self.allreduce_by_workers or {}).values())
        if not all(len(v) == 2 for v in by_workers):
            raise ValueError("device profile: allreduce_by_workers maps a GPU count to [latency_s, link_eff]")
        effs = (self.eff_flops, self.eff_bw, self.attn_eff_flops, self.prefill_block_flops, self.attn_eff_bw,
                self.attn_block_bw, self.link_eff, *self.elem_eff_bw.values(), *(e for _, e in by_workers))
        lats = (self.overhead_s, self.row_overhead_s, self.kernel_s, self.gemm_kernel_s, self.allreduce_latency_s,
                self.prefill_block_s, self.attn_block_s, self.attn_kernel_s, *(self.elem_kernel_s or {}).values(),
                *(lat for lat, _ in by_workers))
        if not all(0 < e <= 1.5 for e in effs) or min(lats) < 0:
            raise ValueError(f"device profile: efficiencies must be in (0, 1.5], latencies >= 0 ({self})")
        if self.allreduce not in ("vllm", "nccl"):
            raise ValueError(f"device profile: allreduce must be vllm or nccl, got {self.allreduce!r}")
        if self.combine not in ("max", "sum", "smooth"):
            raise ValueError(f"device profile: combine must be max, sum or smooth, got {self.combine!r}")
        if not self.ridge_k >= 1:
            raise ValueError(f"device profile: ridge_k must be >= 1, got {self.ridge_k}")
        validate_table(self.gemm_table or {})

    @classmethod
    def for_gpu(cls, name: str) -> DeviceProfile:
        if name not in GPUS:
            raise ValueError(f"--gpu {name!r}: expected one of {', '.join(GPUS)}")
        if name == "cpu":  # no kernel-launch floors: calibration fits overheads, efficiencies, combination
            return cls(GPUS[name], kernel_s=0.0, gemm_kernel_s=0.0, attn_kernel_s=0.0, elem_kernel_s=None,
                       combine="max")
        if name in HOPPER:
            return cls(GPUS[name], **HOPPER_GEMMS, **HOPPER_ATTENTION)
        return cls(GPUS[name])

    def elem_latency(self, op: str) -> float:
        """Latency floor of one launch of element-wise kernel ``op`` (or ``emb``)."""
        return self.kernel_s if self.elem_kernel_s is None else self.elem_kernel_s[op]

    def elem_s(self, op: str, nbytes: float) -> float:
        """One launch of element-wise kernel ``op`` (or ``emb``) moving ``nbytes``."""
        moved = spilled_bytes(nbytes, self.elem_spill[op], self.gpu.l2_bytes)
        return self.elem_latency(op) + moved / (self.gpu.mem_bw * self.elem_eff_bw[op])

    def nccl_link(self, workers: int) -> tuple[float, float]:
        """NCCL's (latency s, link efficiency) among ``workers`` GPUs: fitted for that count, else the shared pair."""
        lat, eff = (self.allreduce_by_workers or {}).get(str(workers), (self.allreduce_latency_s, self.link_eff))
        return float(lat), float(eff)

    def allreduce_s(self, nbytes: float, workers: int) -> float:
        """One ring all-reduce of ``nbytes`` over ``workers`` GPUs."""
        lat, eff = self.nccl_link(workers)
        return lat + ring_allreduce_bytes(nbytes, workers) / (self.gpu.link_bw * eff)

    def tp_allreduce_s(self, nbytes: float, workers: int, bf16: bool) -> float:
        """One of tensor parallelism's all-reduces of ``nbytes`` over ``workers`` GPUs, by the implementation the
        engine picks for its size (``allreduce``; sim/published/allreduce.py)."""
        nccl = self.allreduce_s(nbytes, workers)
        if self.allreduce == "nccl" or self.gpu.name not in HOPPER:
            return nccl
        return vllm_allreduce_s(nbytes, workers, bf16, nccl)

    def allgather_s(self, nbytes: float, workers: int) -> float:
        """One NCCL all-gather whose result is ``nbytes`` on each of ``workers`` GPUs: half a ring all-reduce's
        traffic."""
        lat, eff = self.nccl_link(workers)
        return lat + ring_allreduce_bytes(nbytes, workers) / 2 / (self.gpu.link_bw * eff)

    def gemm_s(self, op: str, tokens: float, rows: int, cols: int, tp: int, dtype_bytes: int) -> float:
        """One launch of GEMM ``op`` ((tokens x rows) @ (rows x cols), sharded ``tp`` ways): measured where
        ``gemm_table`` has its shape (at the next measured token count; past the last, the roofline scaled to
        meet that measurement), else the roofline plus ``gemm_kernel_s``."""
        def modelled(n: float) -> float:
            return self.roofline(*gemm_work(n, rows, cols, tp, dtype_bytes), self.eff_flops,
                                 self.eff_bw) + self.gemm_kernel_s

        curve = self.gemm_table.get(gemm_key(op, rows, cols, tp, dtype_bytes)) if self.gemm_table else None
        if curve is None:
            return modelled(tokens)
        measured = measured_at(curve, tokens)
        return measured if measured is not None else curve[1][-1] * modelled(tokens) / modelled(curve[0][-1])

    def roofline(self, flops: float, nbytes: float, eff_flops: float, eff_bw: float) -> float:
        compute = flops / (self.gpu.peak_flops * eff_flops)
        memory = nbytes / (self.gpu.mem_bw * eff_bw)
        if self.combine == "max":
            return max(compute, memory)
        if self.combine == "sum":
            return compute + memory
        return (compute**self.ridge_k + memory**self.ridge_k) ** (1 / self.ridge_k)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{**data, "gpu": GpuSpec(**data["gpu"])})
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"--profile {path}: not a device profile ({exc})") from None
