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

A mixture of experts (a Mixtral-shaped spec): the MLP becomes the router's GEMM and vLLM's fused MoE op (one
launch per projection for every expert, its gated activation inside: ``published/fused_moe.py``), over the tokens
routed to each expert (``fused_moe.expert_tokens``, uniform or skewed: ``--moe-skew``); ``--ep`` = ``--tp`` deals
whole experts to the GPUs, and with no data parallelism the ranks still combine with the layer's all-reduce.

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

from dataclasses import dataclass

import numpy as np

from strategies.runtime.batch import BatchWork
from strategies.runtime.models.config import DTYPE_BYTES, ModelConfig
from strategies.runtime.sim.attention import decode_attention_s, equal_chunks, prefill_attention_s
from strategies.runtime.sim.kernels import (
    BART_DECODER_GEMMS,
    BART_ENCODER_GEMMS,
    ELEMENTWISE,
    GEMMS,
    elementwise_bytes,
    gemm_work,
    model_shapes,
)
from strategies.runtime.sim.profile import DeviceProfile
from strategies.runtime.sim.published.fused_moe import expert_tokens, fused_moe_s
from strategies.runtime.sim.specs import HOST_LINK_EFFICIENCY

PHASES = ("linear", "attention", "elementwise", "embedding", "lm_head", "communication", "overhead")
SHAPE_CACHE_SIZE = 1 << 16  # distinct (tokens, samples, encoder tokens) kept; a 70B run at batch 256 sees ~4,000

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
    def __init__(self, spec: ModelConfig, profile: DeviceProfile, tp: int = 1, ep: int = 1,
                 moe_skew: float = 0.0) -> None:
        if tp <= 0:
            raise ValueError(f"--tp must be positive, got {tp}")
        if ep != 1 and not spec.is_moe:
            raise ValueError(f"--ep {ep}: expert parallelism needs a mixture-of-experts model spec")
        if ep != 1 and (ep != tp or spec.num_local_experts % ep):
            raise ValueError(f"--ep {ep}: the experts are split over the engine's --tp GPUs ({tp}): --ep must equal "
                             f"--tp and divide the {spec.num_local_experts} experts")
        if moe_skew < 0:
            raise ValueError(f"--moe-skew must be >= 0, got {moe_skew}")
        self.spec, self.profile, self.tp, self.ep = spec, profile, tp, ep
        self.moe_skew = moe_skew  # experts' popularity: expert e takes tokens in proportion to (e + 1) ** -skew
        self.dtype_bytes = DTYPE_BYTES[spec.dtype]
        self.shapes = model_shapes(spec)
        # each GEMM of a layer by name: (weight rows, weight columns) before sharding
        self.gemms = {name: f(*self.shapes) for name, f in GEMMS.items()}
        if spec.is_moe:  # the dense MLP's GEMMs become the router's and the experts' (_moe_terms)
            del self.gemms["mlp_up_proj"], self.gemms["mlp_down_proj"]
        self.encoder_gemms: dict[str, tuple[int, int]] = {}
        if spec.is_encoder_decoder:
            h, i = spec.hidden_size, spec.intermediate_size
            self.gemms = {name: f(h, i) for name, f in BART_DECODER_GEMMS.items()}
            self.encoder_gemms = {name: f(h, i) for name, f in BART_ENCODER_GEMMS.items()}
        self.weight_bytes = spec.num_parameters * self.dtype_bytes
        self.kv_bytes_per_token = 2 * spec.num_hidden_layers * self.shapes[2] * self.dtype_bytes
        self._shape_cache: dict[tuple[int, int, int], dict[str, float]] = {}  # phases(): per distinct shape

    def terms(self, w: BatchWork) -> list[Term]:
        """Every kind of kernel the step runs, with its work per launch on one rank."""
        return self._shape_terms(w.tokens, w.samples, w.encoder_tokens) + self._attention_terms(w)

    def _shape_terms(self, tokens: int, samples: int, encoder_tokens: int) -> list[Term]:
        """The kernels whose work depends only on the step's token and sampled-row counts: GEMMs,
        element-wise kernels, the embedding gather and the LM head."""
        p, s, tp, b, layers = self.profile, self.spec, self.tp, self.dtype_bytes, self.spec.num_hidden_layers
        out = [self._gemm("linear", name, tokens, r, c, layers) for name, (r, c) in self.gemms.items()]
        out += [self._elementwise("elementwise", op, tokens, n * layers) for op, (_, _, n) in ELEMENTWISE.items()
                if not (s.is_moe and op == "mlp_act")]  # (a MoE's activation is inside its fused op)
        if s.is_moe:
            out += self._moe_terms(tokens)
        out.append(self._elementwise("embedding", "emb", tokens, 1))
        head_flops, head_bytes = gemm_work(samples, s.hidden_size, s.vocab_size, tp, b)
        out.append(Term("lm_head", head_flops, head_bytes + samples * s.vocab_size * 4 / tp,  # float32 logits
                        p.eff_flops, p.eff_bw, p.gemm_kernel_s, 1))
        if self.encoder_gemms and encoder_tokens:  # newly encoded requests' outputs become cross K/V, once,
            h = s.hidden_size  # in every layer
            out.append(self._gemm("linear", "cross_attn_kv", encoder_tokens, h, 2 * h, layers))
        return out

    def _moe_terms(self, tokens: int) -> list[Term]:
        """A mixture-of-experts layer: the router's GEMM (replicated on every rank) and the fused MoE op over the
        tokens routed to each expert. Tensor parallelism shards every expert's intermediate width; expert
        parallelism (--ep = --tp) gives each rank E/ep whole experts, contiguous, and the layer waits for the
        busiest rank."""
        p, s, b, layers = self.profile, self.spec, self.dtype_bytes, self.spec.num_hidden_layers
        h, i, e = s.hidden_size, s.intermediate_size, s.num_local_experts
        router = Term("linear", *gemm_work(tokens, h, e, 1, b), p.eff_flops, p.eff_bw, p.gemm_kernel_s, layers,
                      p.gemm_s("moe_router", tokens, h, e, 1, b))
        counts = expert_tokens(tokens, e, s.num_experts_per_tok, self.moe_skew)  # [E]
        inter = i if self.ep > 1 else i / self.tp  # an expert's intermediate width on a rank
        op = max(fused_moe_s(p, c, tokens, h, inter, b) for c in np.split(counts, self.ep))
        return [router, Term("linear", 0.0, 0.0, 1.0, 1.0, 0.0, layers, op)]

    def _attention_terms(self, w: BatchWork) -> list[Term]:
        """Attention: its work depends on every row's context, so it is priced step by step."""
        p, s, tp, b, layers = self.profile, self.spec, self.tp, self.dtype_bytes, self.spec.num_hidden_layers
        pair_flops = 4 * s.num_attention_heads * s.head_dim / tp  # per (query, key) pair and layer
        kv = self.kv_bytes_per_token / layers / tp  # per token and layer
        decode_kv = w.kv_read_tokens - w.context_kv_read_tokens + w.tokens - w.context_tokens  # read + written
        if p.gpu.sms:  # thread blocks in rounds, priced per layer (sim/attention.py)
            heads, kv_heads = max(1, s.num_attention_heads // tp), max(1, s.num_key_value_heads // tp)
            chunks = w.context_chunk_shapes or equal_chunks(w.context_chunks, w.context_tokens,
                                                            w.context_kv_read_tokens)
            prefill = prefill_attention_s(p, chunks, heads, s.head_dim)
            decode = decode_attention_s(p, w.tokens - w.context_tokens, decode_kv, kv_heads, s.head_dim, b)
            out = [Term("attention", 0.0, 0.0, 1.0, 1.0, 0.0, layers, prefill),
                   Term("attention", 0.0, 0.0, 1.0, 1.0, 0.0, layers, decode)]
        else:
            decode_pairs = w.attention_pairs - w.context_attention_pairs
            out = [Term("attention", pair_flops * w.context_attention_pairs,
                        kv * (w.context_kv_read_tokens + w.context_tokens), p.attn_eff_flops, p.eff_bw, 0.0, layers),
                   Term("attention", pair_flops * decode_pairs, kv * decode_kv, p.attn_eff_flops, p.eff_bw, 0.0,
                        layers)]
        out += [Term("attention", 0.0, 0.0, 1.0, 1.0, p.attn_kernel_s, layers),  # the attention kernel's launch
                Term("attention", 0.0, 0.0, 1.0, 1.0, p.kernel_s, layers)]  # the KV-cache write's
        if self.encoder_gemms:  # the decoder's side of cross-attention
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
        return self._encoder_shape_terms(w.encoder_tokens) + self._encoder_attention_terms(w)

    def _encoder_shape_terms(self, encoder_tokens: int) -> list[Term]:
        layers = self.spec.encoder_layers
        if not encoder_tokens:
            return []
        out = [self._gemm("encoder", name, encoder_tokens, r, c, layers) for name, (r, c) in self.encoder_gemms.items()]
        out += [self._elementwise("encoder", op, encoder_tokens, n * layers) for op, (_, _, n) in ELEMENTWISE.items()]
        return out

    def _encoder_attention_terms(self, w: BatchWork) -> list[Term]:
        p, s, tp = self.profile, self.spec, self.tp
        if not w.encoder_tokens:
            return []
        kv = self.kv_bytes_per_token / s.num_hidden_layers / tp
        return [Term("encoder", 4 * s.num_attention_heads * s.head_dim / tp * w.encoder_attention_pairs,
                     kv * w.encoder_tokens, p.attn_eff_flops, p.eff_bw, p.kernel_s, s.encoder_layers)]

    def phases(self, w: BatchWork) -> dict[str, float]:
        """Seconds per phase for one step over ``w``. The cost model is pure, so what depends only on the
        step's shape (tokens, sampled rows, encoder tokens) is priced once per distinct shape; attention
        is priced each step."""
        p = self.profile
        key = (w.tokens, w.samples, w.encoder_tokens)
        shape = self._shape_cache.get(key)
        if shape is None:
            if len(self._shape_cache) >= SHAPE_CACHE_SIZE:
                self._shape_cache.clear()
            shape = self._shape_cache[key] = self._shape_phases(*key)
        secs = dict(shape)
        secs["attention"] = sum(t.seconds(p) for t in self._attention_terms(w))
        if self.encoder_gemms:
            secs["encoder"] += sum(t.seconds(p) for t in self._encoder_attention_terms(w))
        return secs

    def _shape_phases(self, tokens: int, samples: int, encoder_tokens: int) -> dict[str, float]:
        p, s, tp = self.profile, self.spec, self.tp
        secs = dict.fromkeys(PHASES, 0.0)
        for t in self._shape_terms(tokens, samples, encoder_tokens):
            secs[t.phase] += t.seconds(p)
        if tp > 1:  # two per layer, attention's and the MLP's outputs (under EP with no data parallelism too: vLLM
            # dispatches by all-to-all only across data-parallel ranks; here every rank holds every token)
            nbytes = tokens * s.hidden_size * self.dtype_bytes  # the layer's output activations
            allreduce = p.tp_allreduce_s(nbytes, tp, s.dtype == "bfloat16")
            per_layer = 2 * allreduce
            # and once a forward: the vocabulary-parallel embedding's all-reduce, the sampled rows' logits gathered
            secs["communication"] = s.num_hidden_layers * per_layer + allreduce + (
                p.allgather_s(samples * s.vocab_size * self.dtype_bytes, tp) if samples else 0.0)
        secs["overhead"] = p.overhead_s + p.row_overhead_s * samples
        if self.encoder_gemms:
            secs["encoder"] = sum(t.seconds(p) for t in self._encoder_shape_terms(encoder_tokens))
            if tp > 1 and encoder_tokens:
                nbytes = encoder_tokens * s.hidden_size * self.dtype_bytes
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

    def host_copy_s(self, blocks: int, tokens_per_block: int, stages: int = 1) -> float:
        """``blocks`` KV blocks between the GPUs and the host tier: each rank moves its share (its KV heads, its
        stage's layers) over its own PCIe link, all at once — bytes over the link's achieved bandwidth (a DMA per
        block, its setup hidden behind the next's transfer)."""
        s = self.spec
        kv_heads = max(1, s.num_key_value_heads // self.tp)
        nbytes = blocks * tokens_per_block * 2 * s.num_hidden_layers * kv_heads * s.head_dim * self.dtype_bytes
        return nbytes / stages / (self.profile.gpu.host_link_bw * HOST_LINK_EFFICIENCY)

    def step_time(self, w: BatchWork) -> float:
        return sum(self.phases(w).values())

    def kv_capacity_tokens(self, memory_fraction: float = 0.9, draft: CostModel | None = None) -> int:
        """KV tokens that fit in the GPUs' memory after the weights (TP shards both); with a draft model
        (speculative decoding) its weights come off too and each token keeps the draft's KV beside the target's."""
        free = self.tp * self.profile.gpu.mem_bytes * memory_fraction - self.weight_bytes
        per_token = self.kv_bytes_per_token
        if draft is not None:
            free -= draft.weight_bytes
            per_token += draft.kv_bytes_per_token
        return max(0, int(free // per_token))
