"""A step's kernels and the work each one does: what the cost model prices, independent of any GPU.

One decoder layer of a Llama-style model runs four GEMMs (``GEMMS``, each by the weight it multiplies),
attention, and element-wise kernels (``ELEMENTWISE``: two RMSNorms, RoPE, the gated activation, two
residual adds); a BART layer its own GEMMs; a mixture-of-experts layer's fused kernels are priced in
``published/fused_moe.py``.
The functions below count one kernel's FLOPs and bytes on one tensor-parallel rank; ``profile.py`` turns
them into seconds on a GPU.
"""

from __future__ import annotations

from strategies.runtime.models.config import ModelConfig

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
