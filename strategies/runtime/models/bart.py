"""A BART encoder–decoder over packed token batches: the encoder as its own device piece, the decoder
with paged self-attention KV and a paged cross-attention KV cache.

``encode`` runs the newly admitted requests' encoder inputs, packed like context tokens (each request
attends to its own tokens only, non-causally), and returns the encoder's last hidden states. The engine
keeps them per request (``EncoderBuffers``). In the request's first decoder step, every decoder layer
projects them once into its cross-attention keys and values (``fill_src`` → ``fill_dst`` pages of the
cross pool); from then on, context and generation tokens read the cross KV through the request's row of
the cross block table and never see the encoder output again. Post-LayerNorm layers, learned positions
(offset 2), GELU, tied embeddings plus ``final_logits_bias``: Hugging Face's ``BartForConditionalGeneration``,
whose checkpoint names the modules mirror.
"""

from __future__ import annotations

import torch
from torch import nn

from strategies.runtime.kv.paged_attention import generation_attention, paged_attention, step_indices
from strategies.runtime.models.config import ModelConfig

POSITION_OFFSET = 2  # BART's learned positions start at index 2 (TorchScript reads no globals: 2 below)


class BartAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj, self.k_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.v_proj, self.out_proj = nn.Linear(h, h), nn.Linear(h, h)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x).view(x.size(0), self.num_heads, self.head_dim)  # [T, H, D]

    def k(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_proj(x).view(x.size(0), self.num_heads, self.head_dim)  # [T, H, D]

    def v(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_proj(x).view(x.size(0), self.num_heads, self.head_dim)  # [T, H, D]


class BartEncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.self_attn = BartAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(h, eps=eps)
        self.fc1, self.fc2 = nn.Linear(h, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, h)
        self.final_layer_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, starts: list[int], lens: list[int]) -> torch.Tensor:
        a = self.self_attn
        q, k, v = a.q(x), a.k(x), a.v(x)
        out = torch.empty_like(q)  # [E, H, D]
        for i in range(len(starts)):  # each request sees its whole input, its own only
            s, n = starts[i], lens[i]
            qi = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k[s:s + n].transpose(0, 1).unsqueeze(0)
            vi = v[s:s + n].transpose(0, 1).unsqueeze(0)
            out[s:s + n] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1)
        x = self.self_attn_layer_norm(x + a.out_proj(out.reshape(x.size(0), -1)))
        return self.final_layer_norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class BartDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.self_attn = BartAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(h, eps=eps)
        self.encoder_attn = BartAttention(cfg)
        self.encoder_attn_layer_norm = nn.LayerNorm(h, eps=eps)
        self.fc1, self.fc2 = nn.Linear(h, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, h)
        self.final_layer_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
                ctx_starts: list[int], ctx_lens: list[int], ctx_pos0: list[int], ctx_kv: list[torch.Tensor],
                num_ctx_tokens: int, rows: torch.Tensor, gen_kv: torch.Tensor, gen_mask: torch.Tensor,
                ck_pool: torch.Tensor,
                cv_pool: torch.Tensor, encoded: torch.Tensor, fill_dst: torch.Tensor, cross_ctx: list[torch.Tensor],
                cross_gen_kv: torch.Tensor, cross_gen_mask: torch.Tensor) -> torch.Tensor:
        t = x.size(0)
        a = self.self_attn
        o = paged_attention(a.q(x), a.k(x), a.v(x), k_pool, v_pool, kv_index, ctx_starts, ctx_lens, ctx_pos0, ctx_kv,
                            num_ctx_tokens, rows, gen_kv, gen_mask)
        x = self.self_attn_layer_norm(x + a.out_proj(o.reshape(t, -1)))
        c = self.encoder_attn
        if fill_dst.size(0) > 0:  # a request's first decoder step: its encoder output becomes cross KV, once
            ck_pool.index_copy_(1, fill_dst, c.k(encoded).transpose(0, 1))  # [H, pages, D]
            cv_pool.index_copy_(1, fill_dst, c.v(encoded).transpose(0, 1))
        q = c.q(x)  # [T, H, D]
        o = torch.empty_like(q)
        for i in range(len(ctx_starts)):  # a context chunk attends to its request's whole encoder output
            s, n = ctx_starts[i], ctx_lens[i]
            ki = ck_pool.index_select(1, cross_ctx[i]).unsqueeze(0)  # [1, H, E, D]
            vi = cv_pool.index_select(1, cross_ctx[i]).unsqueeze(0)
            o[s:s + n] = torch.nn.functional.scaled_dot_product_attention(
                q[s:s + n].transpose(0, 1).unsqueeze(0), ki, vi)[0].transpose(0, 1)
        if t > num_ctx_tokens:
            o[num_ctx_tokens:] = generation_attention(q[num_ctx_tokens:], ck_pool, cv_pool, cross_gen_kv,
                                                      cross_gen_mask)
        x = self.encoder_attn_layer_norm(x + c.out_proj(o.reshape(t, -1)))
        return self.final_layer_norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class BartStack(nn.Module):
    """The encoder's or the decoder's learned positions, embedding LayerNorm and layers (HF's names)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.layernorm_embedding = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(layers)


class BartModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.shared = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.encoder = BartStack(cfg, [BartEncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.decoder = BartStack(cfg, [BartDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.shared.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))  # [1, V]
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.scale_embedding else 1.0

    @torch.jit.export
    def encode(self, ids: torch.Tensor, positions: torch.Tensor, starts: list[int], lens: list[int]) -> torch.Tensor:
        """ids, positions [E]: the packed encoder inputs of newly admitted requests; returns [E, hidden]."""
        x = self.shared(ids) * self.embed_scale + self.encoder.embed_positions(positions + 2)  # POSITION_OFFSET
        x = self.encoder.layernorm_embedding(x)
        for layer in self.encoder.layers:
            x = layer(x, starts, lens)
        return x

    @torch.jit.export
    def step(self, tokens: torch.Tensor, block_table: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
             ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int, tokens_per_block: int,
             sample_rows: torch.Tensor, last_token: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor,
             logits_out: torch.Tensor, cache_indirection: torch.Tensor, max_beam: int, encoded: torch.Tensor,
             fill_dst: torch.Tensor, ck_pools: torch.Tensor, cv_pools: torch.Tensor, cross_table: torch.Tensor,
             cross_lens: list[int], cross_len: torch.Tensor, cross_kmax: int) -> None:
        """The decoder's forward as one call; the first 15 arguments as ``LlamaModel.step``. ``encoded
        [F, hidden]`` → ``fill_dst [F]``: encoder outputs to project into cross KV pages in this step;
        ``cross_table [R, Wc]``: each request row's cross pages, rows in the block table's order; its
        encoder length as host ints ``cross_lens`` (a context chunk's kernel shapes) and on the device
        ``cross_len [R]`` (the generation rows' mask)."""
        # (an encoder–decoder step keeps its chunks whole: their cross-attention is per chunk)
        ctx_kv, self_rows, gen_kv, gen_mask = step_indices(tokens, block_table, ctx_starts, ctx_lens, ctx_pos0,
                                                           num_ctx_tokens, gen_kmax, tokens_per_block, last_token,
                                                           cache_indirection, max_beam, k_pools, False)
        token_ids, positions = tokens[:, 0], tokens[:, 1]
        t = tokens.size(0)
        dev = tokens.device
        n_ctx = len(ctx_starts)
        cross_ctx: list[torch.Tensor] = []
        for i in range(n_ctx):  # each context chunk reads its request's whole encoder output
            e = torch.arange(cross_lens[i], device=dev)
            cross_ctx.append(cross_table[i, e // tokens_per_block] * tokens_per_block + e % tokens_per_block)
        g = t - num_ctx_tokens
        epos = torch.arange(cross_kmax, device=dev)  # [Ec]
        rows = cross_table[n_ctx:n_ctx + g]  # [G, Wc]
        cross_gen_kv = (rows[:, epos // tokens_per_block] * tokens_per_block + epos % tokens_per_block).flatten()
        lens = cross_len[n_ctx:n_ctx + g]  # [G]
        hidden = (epos.unsqueeze(0) >= lens.unsqueeze(1)).view(1, g, 1, cross_kmax)  # past each one's encoder input
        cross_gen_mask = torch.zeros(hidden.shape, dtype=k_pools.dtype, device=dev).masked_fill(hidden, float("-inf"))
        x = self.shared(token_ids) * self.embed_scale + self.decoder.embed_positions(positions + 2)  # POSITION_OFFSET
        x = self.decoder.layernorm_embedding(x)
        layer = 0
        for block in self.decoder.layers:
            x = block(x, k_pools[layer], v_pools[layer], tokens[:, 3], ctx_starts, ctx_lens, ctx_pos0, ctx_kv,
                      num_ctx_tokens, self_rows, gen_kv, gen_mask, ck_pools[layer], cv_pools[layer], encoded, fill_dst,
                      cross_ctx, cross_gen_kv, cross_gen_mask)
            layer += 1  # noqa: SIM113 - TorchScript indexes the pools by a plain int
        logits = self.lm_head(x[sample_rows]) + self.final_logits_bias  # [B, V]
        logits_out[: logits.size(0)].copy_(logits)


def build_bart(cfg: ModelConfig) -> BartModel:
    """Seeded random weights (LayerNorms at identity, biases at zero), as ``build_model`` for Llama."""
    gen = torch.Generator().manual_seed(cfg.seed)
    model = BartModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05)
    return model
