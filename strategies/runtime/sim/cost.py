"""A cost model for one forward over the batch actually scheduled, kernel by kernel, summed by phase.

A GPU runs a step's kernels one after another, so each kind of kernel is priced on its own roofline,
with its own efficiency and launch latency, and the times are summed (one ``max`` over a whole step
would let decode attention's memory traffic hide behind the GEMMs' FLOPs, which it does not):

- ``linear``: the layers' four GEMMs; FLOPs 2 × tokens × weight size, bytes the weights once per step
  plus the activations in and out.
- ``attention``: prefill (context chunks; compute-bound) and decode (generation rows; memory-bound)
  priced apart, as thread blocks in rounds over the GPU's SMs (sim/attention.py); on a CPU a roofline of
  4 × heads × head dim FLOPs per (query, key) pair and the KV bytes read and written.
- ``elementwise``: two RMSNorms, RoPE, the gated activation, two residual adds; bytes only, each kernel
  its own bandwidth efficiency (and cost of the bytes past the L2), plus a launch latency that dominates
  small batches.
- ``embedding``: a gather of the batch's rows (not the whole table).
- ``lm_head``: the sampled rows only; weights plus float32 logits.
- ``communication``: tensor parallelism's two all-reduces per layer, latency plus ring traffic.
- ``overhead``: per step and per sampled row (launches, synchronisation; what a CPU's small GEMMs lose).

Encoder–decoder models (a BART-shaped spec): an ``encoder`` phase prices the encode piece (its layers'
GEMMs, non-causal attention and element-wise kernels over the admitted requests' encoder tokens); the
decoder's layers have BART's six GEMMs, project newly encoded requests into cross-attention K/V
(``linear``), and read cross KV (``attention``: a chunk or a row reads its request's encoder output).
BART's element-wise kernels are priced with the table below (LayerNorms for RMSNorms; no RoPE, one more
norm and add): a stated approximation, unchecked against measured kernels.

Tensor parallelism shards the GEMMs, attention heads, LM head, KV, RoPE and the activation; norms, adds
and the embedding gather run whole on every rank. The dtype is the spec's (a config.json's
``torch_dtype``, or ``--dtype``). A device profile holds the efficiencies and latencies: datasheet
defaults, fitted to a real run by ``slotbench calibrate RUN_DIR``, or to published per-operator kernel
tables by ``slotbench calibrate --op-profile`` — which prices each measured kernel with the same
functions below, so what is fitted is what a simulated step sums, and keeps the measured GEMMs: a GEMM
of a shape they measured costs what they measured (sim/gemm_table.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from strategies.runtime.batch import BatchWork
from strategies.runtime.model_config import ModelConfig
from strategies.runtime.sim.attention import decode_attention_s, prefill_attention_s
from strategies.runtime.sim.gemm_table import GemmTable, gemm_key, measured_at, validate_table
from strategies.runtime.sim.specs import GPUS, GpuSpec

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
PHASES = ("linear", "attention", "elementwise", "embedding", "lm_head", "communication", "overhead")

# One layer's kernels as functions of (hidden, query width, KV width, intermediate).
# GEMMs: (weight rows, weight columns), sharded across TP ranks.
GEMMS = {
    "attn_pre_proj": lambda h, q, kv, i: (h, q + 2 * kv),
    "attn_post_proj": lambda h, q, kv, i: (q, h),
    "mlp_up_proj": lambda h, q, kv, i: (h, 2 * i),
    "mlp_down_proj": lambda h, q, kv, i: (i, h),
}
# Element-wise kernels: (elements read + written per token, sharded across TP ranks, launches per layer).
ELEMENTWISE = {
    "input_layernorm": (lambda h, q, kv, i: 2 * h, False, 1),
    "post_attention_layernorm": (lambda h, q, kv, i: 2 * h, False, 1),
    "attn_rope": (lambda h, q, kv, i: 2 * (q + kv), True, 1),
    "mlp_act": (lambda h, q, kv, i: 3 * i, True, 1),
    "add": (lambda h, q, kv, i: 3 * h, False, 2),  # the two residual adds
}
# BART: a decoder layer's GEMMs (self-attention QKV and output, cross-attention query and output, FFN),
# an encoder layer's, and the cross K/V projection of encoder outputs (per decoder layer).
BART_DECODER_GEMMS = {"self_attn_qkv": lambda h, i: (h, 3 * h), "self_attn_out": lambda h, i: (h, h),
                      "cross_attn_q": lambda h, i: (h, h), "cross_attn_out": lambda h, i: (h, h),
                      "fc1": lambda h, i: (h, i), "fc2": lambda h, i: (i, h)}
BART_ENCODER_GEMMS = {"encoder_self_attn_qkv": lambda h, i: (h, 3 * h), "encoder_self_attn_out": lambda h, i: (h, h),
                      "encoder_fc1": lambda h, i: (h, i), "encoder_fc2": lambda h, i: (i, h)}
EMBEDDING_ELEMENTS = 2  # per token and hidden unit: the row read, the activation written
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


def spilled_bytes(nbytes: float, spill: float, l2_bytes: float) -> float:
    """``nbytes`` as priced at DRAM bandwidth: the share beyond L2_RESIDENT of the L2 costs 1 + ``spill``."""
    if not spill or not l2_bytes or nbytes <= L2_RESIDENT * l2_bytes:
        return nbytes
    return nbytes + spill * (nbytes - L2_RESIDENT * l2_bytes)


def model_shapes(spec: ModelConfig) -> tuple[int, int, int, int]:
    """(hidden, query width, KV width, intermediate): what the kernel tables above are functions of."""
    return (spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim,
            spec.intermediate_size)


def gemm_work(tokens: float, rows: int, cols: int, tp: int, dtype_bytes: int) -> tuple[float, float]:
    """FLOPs and bytes of one GEMM on one rank: (tokens x rows) @ (rows x cols), sharded ``tp`` ways."""
    return 2 * tokens * rows * cols / tp, (rows * cols + tokens * (rows + cols)) * dtype_bytes / tp


def elementwise_bytes(op: str, tokens: float, shapes: tuple[int, int, int, int], tp: int, dtype_bytes: int) -> float:
    """Bytes one element-wise kernel (or ``emb``, the embedding gather) moves on one rank."""
    if op == "emb":
        return tokens * EMBEDDING_ELEMENTS * shapes[0] * dtype_bytes
    elements, sharded, _ = ELEMENTWISE[op]
    return tokens * elements(*shapes) * dtype_bytes / (tp if sharded else 1)


def ring_allreduce_bytes(nbytes: float, workers: int) -> float:
    """What each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (workers - 1) / workers * nbytes


@dataclass(frozen=True)
class DeviceProfile:
    gpu: GpuSpec
    eff_flops: float = 0.7  # GEMMs (linear, LM head): achieved / peak FLOP/s
    eff_bw: float = 0.8  # GEMMs' weight streaming and attention's KV: achieved / peak bandwidth
    gemm_kernel_s: float = 4e-6  # latency floor of one GEMM
    # Attention, as thread blocks in rounds over the SMs (sim/attention.py; fitted to Vidur's A100
    # FlashAttention-2 table, so in-sample on A100 and assumed elsewhere). Without SMs (a CPU), a roofline
    # of attn_eff_flops and eff_bw.
    attn_eff_flops: float = 0.34  # prefill: achieved / peak FLOP/s with every SM busy
    prefill_block_flops: float = 0.49  # prefill: one thread block's FLOP/s / an SM's share of the peak
    prefill_block_s: float = 46e-6  # prefill: one thread block's fixed cost
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
        return cls(GPUS[name])

    def elem_latency(self, op: str) -> float:
        """Latency floor of one launch of element-wise kernel ``op`` (or ``emb``)."""
        return self.kernel_s if self.elem_kernel_s is None else self.elem_kernel_s[op]

    def elem_s(self, op: str, nbytes: float) -> float:
        """One launch of element-wise kernel ``op`` (or ``emb``) moving ``nbytes``."""
        moved = spilled_bytes(nbytes, self.elem_spill[op], self.gpu.l2_bytes)
        return self.elem_latency(op) + moved / (self.gpu.mem_bw * self.elem_eff_bw[op])

    def allreduce_s(self, nbytes: float, workers: int) -> float:
        """One ring all-reduce of ``nbytes`` over ``workers`` GPUs."""
        lat, eff = (self.allreduce_by_workers or {}).get(str(workers), (self.allreduce_latency_s, self.link_eff))
        return lat + ring_allreduce_bytes(nbytes, workers) / (self.gpu.link_bw * eff)

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


@dataclass(frozen=True)
class Term:
    """One kind of kernel in a step, on one rank: its work per launch, how it is priced, how often."""

    phase: str
    flops: float
    bytes: float
    eff_flops: float
    eff_bw: float
    latency_s: float  # per launch
    count: int  # launches per step (layers x launches per layer)
    launch_s: float | None = None  # one launch priced already (GEMMs, element-wise kernels); None: the roofline

    def seconds(self, p: DeviceProfile) -> float:
        if self.launch_s is not None:
            return self.count * self.launch_s
        return self.count * (p.roofline(self.flops, self.bytes, self.eff_flops, self.eff_bw) + self.latency_s)


class CostModel:
    def __init__(self, spec: ModelConfig, profile: DeviceProfile, tp: int = 1) -> None:
        if tp <= 0:
            raise ValueError(f"--tp must be positive, got {tp}")
        self.spec, self.profile, self.tp = spec, profile, tp
        self.dtype_bytes = DTYPE_BYTES[spec.dtype]
        self.shapes = model_shapes(spec)
        # each GEMM of a layer by name: (weight rows, weight columns) before sharding
        self.gemms = {name: f(*self.shapes) for name, f in GEMMS.items()}
        self.encoder_gemms: dict[str, tuple[int, int]] = {}
        if spec.is_encoder_decoder:
            h, i = spec.hidden_size, spec.intermediate_size
            self.gemms = {name: f(h, i) for name, f in BART_DECODER_GEMMS.items()}
            self.encoder_gemms = {name: f(h, i) for name, f in BART_ENCODER_GEMMS.items()}
        self.weight_bytes = spec.num_parameters * self.dtype_bytes
        self.kv_bytes_per_token = 2 * spec.num_hidden_layers * self.shapes[2] * self.dtype_bytes

    def terms(self, w: BatchWork) -> list[Term]:
        """Every kind of kernel the step runs, with its work per launch on one rank."""
        p, s, tp, b, layers = self.profile, self.spec, self.tp, self.dtype_bytes, self.spec.num_hidden_layers
        out = [self._gemm("linear", name, w.tokens, r, c, layers) for name, (r, c) in self.gemms.items()]
        pair_flops = 4 * s.num_attention_heads * s.head_dim / tp  # per (query, key) pair and layer
        kv = self.kv_bytes_per_token / layers / tp  # per token and layer
        decode_kv = w.kv_read_tokens - w.context_kv_read_tokens + w.tokens - w.context_tokens  # read + written
        if p.gpu.sms:  # thread blocks in rounds, priced per layer (sim/attention.py)
            heads, kv_heads = max(1, s.num_attention_heads // tp), max(1, s.num_key_value_heads // tp)
            prefill = prefill_attention_s(p, w.context_chunks, w.context_tokens, w.context_kv_read_tokens, heads,
                                          s.head_dim)
            decode = decode_attention_s(p, w.tokens - w.context_tokens, decode_kv, kv_heads, s.head_dim, b)
            out += [Term("attention", 0.0, 0.0, 1.0, 1.0, 0.0, layers, prefill),
                    Term("attention", 0.0, 0.0, 1.0, 1.0, 0.0, layers, decode)]
        else:
            decode_pairs = w.attention_pairs - w.context_attention_pairs
            out += [Term("attention", pair_flops * w.context_attention_pairs,
                         kv * (w.context_kv_read_tokens + w.context_tokens), p.attn_eff_flops, p.eff_bw, 0.0, layers),
                    Term("attention", pair_flops * decode_pairs, kv * decode_kv, p.attn_eff_flops, p.eff_bw, 0.0,
                         layers)]
        out += [Term("attention", 0.0, 0.0, 1.0, 1.0, p.attn_kernel_s, layers),  # the attention kernel's launch
                Term("attention", 0.0, 0.0, 1.0, 1.0, p.kernel_s, layers)]  # the KV-cache write's
        out += [self._elementwise("elementwise", op, w.tokens, n * layers) for op, (_, _, n) in ELEMENTWISE.items()]
        out.append(self._elementwise("embedding", "emb", w.tokens, 1))
        head_flops, head_bytes = gemm_work(w.samples, s.hidden_size, s.vocab_size, tp, b)
        out.append(Term("lm_head", head_flops, head_bytes + w.samples * s.vocab_size * 4 / tp,  # float32 logits
                        p.eff_flops, p.eff_bw, p.gemm_kernel_s, 1))
        if self.encoder_gemms:  # the decoder's side of cross-attention
            h = s.hidden_size
            if w.encoder_tokens:  # newly encoded requests' outputs become cross K/V, once, in every layer
                out.append(self._gemm("linear", "cross_attn_kv", w.encoder_tokens, h, 2 * h, layers))
            out.append(Term("attention", pair_flops * w.cross_attention_pairs,
                            kv * (w.cross_kv_read_tokens + w.encoder_tokens), p.attn_eff_flops, p.eff_bw, p.kernel_s,
                            layers))
        return out

    def _gemm(self, phase: str, name: str, tokens: int, rows: int, cols: int, count: int) -> Term:
        """A GEMM's term: its work, priced by ``DeviceProfile.gemm_s`` (measured, where the profile has its shape)."""
        p, tp, b = self.profile, self.tp, self.dtype_bytes
        return Term(phase, *gemm_work(tokens, rows, cols, tp, b), p.eff_flops, p.eff_bw, p.gemm_kernel_s, count,
                    p.gemm_s(name, tokens, rows, cols, tp, b))

    def _elementwise(self, phase: str, op: str, tokens: int, count: int) -> Term:
        """An element-wise kernel's term: its bytes, priced by ``DeviceProfile.elem_s`` (latency in it)."""
        nbytes = elementwise_bytes(op, tokens, self.shapes, self.tp, self.dtype_bytes)
        return Term(phase, 0.0, nbytes, 1.0, 1.0, 0.0, count, self.profile.elem_s(op, nbytes))

    def encoder_terms(self, w: BatchWork) -> list[Term]:
        """The encode piece: the encoder's layers over the admitted requests' encoder tokens."""
        p, s, tp, layers = self.profile, self.spec, self.tp, self.spec.encoder_layers
        if not w.encoder_tokens:
            return []
        out = [self._gemm("encoder", name, w.encoder_tokens, r, c, layers)
               for name, (r, c) in self.encoder_gemms.items()]
        kv = self.kv_bytes_per_token / s.num_hidden_layers / tp
        out.append(Term("encoder", 4 * s.num_attention_heads * s.head_dim / tp * w.encoder_attention_pairs,
                        kv * w.encoder_tokens, p.attn_eff_flops, p.eff_bw, p.kernel_s, layers))
        out += [self._elementwise("encoder", op, w.encoder_tokens, n * layers) for op, (_, _, n) in ELEMENTWISE.items()]
        return out

    def phases(self, w: BatchWork) -> dict[str, float]:
        """Seconds per phase for one step over ``w``."""
        p, s, tp = self.profile, self.spec, self.tp
        secs = dict.fromkeys(PHASES, 0.0)
        for t in self.terms(w):
            secs[t.phase] += t.seconds(p)
        if tp > 1:  # two per layer (attention and MLP outputs)
            nbytes = w.tokens * s.hidden_size * self.dtype_bytes  # the layer's output activations
            secs["communication"] = 2 * s.num_hidden_layers * p.allreduce_s(nbytes, tp)
        secs["overhead"] = p.overhead_s + p.row_overhead_s * w.samples
        if self.encoder_gemms:
            secs["encoder"] = sum(t.seconds(p) for t in self.encoder_terms(w))
            if tp > 1 and w.encoder_tokens:
                nbytes = w.encoder_tokens * s.hidden_size * self.dtype_bytes
                secs["encoder"] += 2 * s.encoder_layers * p.allreduce_s(nbytes, tp)
        return secs

    def stage_times(self, w: BatchWork, stages: int) -> tuple[list[float], float]:
        """Pipeline parallelism: each stage's share of a step (layers split evenly; the embedding on the
        first stage, the LM head on the last; every stage its own launch overhead), and the time the
        hidden states take from one stage to the next (one point-to-point send over the link)."""
        secs = self.phases(w)
        layers = sum(secs[k] for k in ("linear", "attention", "elementwise", "communication"))
        out = [layers / stages + secs["overhead"] for _ in range(stages)]
        out[0] += secs["embedding"] + secs.get("encoder", 0.0)
        out[-1] += secs["lm_head"]
        p = self.profile
        hop = p.allreduce_latency_s + w.tokens * self.spec.hidden_size * self.dtype_bytes / (p.gpu.link_bw * p.link_eff)
        return out, hop

    def step_time(self, w: BatchWork) -> float:
        return sum(self.phases(w).values())

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit in the GPUs' memory after the weights (TP shards both)."""
        free = self.tp * self.profile.gpu.mem_bytes * memory_fraction - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))
