"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, or Mixtral's mixture of experts:
``moe.py``) over a packed token batch.

The forward takes one flat list of tokens that mixes context (prefill) chunks and generation steps of
different requests. Every token carries the page it writes its key and value to (the paged KV cache:
``kv/pool.py``); attention reads a request's history back through its row of the step's block table,
so a request's history never has to travel with the batch. The module is TorchScript-compatible: on CPU the whole
forward runs as one scripted call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from strategies.runtime.kv.paged_attention import paged_attention, step_indices
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.models.moe import SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Variance in float32 at least, as Hugging Face does, so bf16 runs agree with the reference.
        xf = x.float() if x.dtype != torch.float64 else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(rope_theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies, [D/2], in float32, as Hugging Face computes them."""
    return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


class RopeAngles(nn.Module):
    """RoPE's inverse frequencies, kept in float32 whatever the model's dtype, as Hugging Face keeps them.

    Rounded to bfloat16 (8 bits of mantissa) an inverse frequency is off by up to 0.2%, so the angle at
    position 3,000 is off by radians: a cast of the model (``.to(bfloat16)``, ``.half()``) must move them
    to its device and leave their precision alone. ``_apply`` (every cast and move goes through it)
    recomputes them in float32 on wherever the cast put them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rope_theta, self.head_dim = cfg.rope_theta, cfg.head_dim
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope_theta, cfg.head_dim), persistent=False)  # [D/2]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RopeAngles:
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.rope_theta, self.head_dim).to(self.inv_freq.device)
        return self


@torch.jit.script
def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D] of each token's position, broadcast over heads: angles in float32 (positions
    times float32 inverse frequencies, HF's ``inv_freq @ position_ids`` with autocast off), then cast."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, D/2] float32
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, kv_index: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
                ctx_pos0: list[int], ctx_kv: list[torch.Tensor], num_ctx_tokens: int, rows: torch.Tensor,
                gen_kv: torch.Tensor, gen_mask: torch.Tensor) -> torch.Tensor:
        t = x.size(0)
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = paged_attention(q, k, v, k_pool, v_pool, kv_index, ctx_starts, ctx_lens, ctx_pos0, ctx_kv, num_ctx_tokens,
                              rows, gen_kv, gen_mask)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, kv_index: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
                ctx_pos0: list[int], ctx_kv: list[torch.Tensor], num_ctx_tokens: int, rows: torch.Tensor,
                gen_kv: torch.Tensor, gen_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_pool, v_pool, kv_index, ctx_starts, ctx_lens,
                               ctx_pos0, ctx_kv, num_ctx_tokens, rows, gen_kv, gen_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding → decoder layers → final norm → LM head, evaluated only at the rows that sample."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RopeAngles(cfg)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_index: torch.Tensor,
                k_pools: torch.Tensor, v_pools: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
                ctx_pos0: list[int], ctx_kv: list[torch.Tensor], num_ctx_tokens: int, rows: torch.Tensor,
                gen_kv: torch.Tensor, gen_mask: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        """token_ids, positions, kv_index: [T]; k_pools, v_pools: [L, Hkv, pages, D]; ctx_kv: page
        indices of every key a later context chunk reads; rows [R']: the tokens that attend one query each
        (empty: the generation rows); gen_kv [R'*K] / gen_mask [1, R', 1, K]: those rows' pages and the additive
        mask (0 or -inf) of what each row may see (kv/paged_attention.py)."""
        x = self.embed_tokens(token_ids)  # [T, hidden]
        cos, sin = rope_tables(positions, self.rope.inv_freq, x.dtype)  # [T, 1, D]
        layer = 0
        for block in self.layers:
            x = block(x, cos, sin, k_pools[layer], v_pools[layer], kv_index, ctx_starts, ctx_lens, ctx_pos0,
                      ctx_kv, num_ctx_tokens, rows, gen_kv, gen_mask)
            layer += 1  # noqa: SIM113 - TorchScript indexes the pools by a plain int
        return self.lm_head(self.norm(x[sample_rows]))  # [B, vocab]

    @torch.jit.export
    def step(self, tokens: torch.Tensor, block_table: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
             ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int, tokens_per_block: int,
             sample_rows: torch.Tensor, last_token: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor,
             logits_out: torch.Tensor, cache_indirection: torch.Tensor, max_beam: int) -> None:
        """The engine's forward as one call. tokens [T, 4]: id, position, decoder row (slot * max_beam +
        beam), page index; block_table [R, W]: the pages of each row in the step (context chunks, then
        generation rows, a beam request's beams adjacent). Generation inputs are read from the decoder
        state's ``last_token`` rows on the device; logits land in ``logits_out`` (float32 whatever the
        model dtype, as Hugging Face samples). ``cache_indirection [S * max_beam, L]`` (empty without beam
        search): for each beam row and position, which beam of the request wrote that position's key."""
        ctx_kv, rows, gen_kv, gen_mask = step_indices(tokens, block_table, ctx_starts, ctx_lens, ctx_pos0,
                                                      num_ctx_tokens, gen_kmax, tokens_per_block, last_token,
                                                      cache_indirection, max_beam, k_pools, True)
        token_ids, positions = tokens[:, 0], tokens[:, 1]
        logits = self.forward(token_ids, positions, tokens[:, 3], k_pools, v_pools, ctx_starts, ctx_lens, ctx_pos0,
                              ctx_kv, num_ctx_tokens, rows, gen_kv, gen_mask, sample_rows)
        logits_out[: logits.size(0)].copy_(logits)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """A model with seeded random weights (no hub access): the same config and seed give the same model."""
    if cfg.is_encoder_decoder:
        from strategies.runtime.models.bart import build_bart

        return build_bart(cfg).to(device=device, dtype=cfg.torch_dtype).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=cfg.torch_dtype).eval().requires_grad_(False)


def script_model(model: nn.Module) -> torch.nn.Module:
    """The model as one TorchScript module, so that its forward runs as one GIL-free call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(model)
