"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a packed token batch.

The forward takes one flat list of tokens that mixes context (prefill) chunks and generation steps of
different requests. Every token is bound to a request slot; keys and values are written into the
per-slot KV cache at the token's position and attention reads the slot's cache back, so a request's
history never has to travel with the batch. The module is TorchScript-compatible: on CPU the whole
forward runs as one scripted call that releases the GIL (see ``device.py`` for why that matters).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-style model; field names follow Hugging Face's LlamaConfig."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_id: int = 2
    dtype: str = "float32"
    seed: int = 0  # seeds the random weights of a preset; unused for a loaded checkpoint

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model config: hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("model config: head_dim must be even for RoPE")
        if self.dtype not in _DTYPES:
            raise ValueError(f"model config: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("model config: eos_token_id must be inside the vocabulary")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + h

    def with_dtype(self, dtype: str) -> ModelConfig:
        return replace(self, dtype=dtype)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # Fast enough for the test suite: every strategy runs a few hundred requests in seconds.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024),
    # For benchmarks: large enough that the device step dominates a host step on CPU.
    "small": ModelConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=688, max_position_embeddings=2048),
}


def resolve_model_config(name_or_path: str) -> ModelConfig:
    """A preset name, or a Hugging Face checkpoint directory (its ``config.json``)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                         "and not a checkpoint directory with config.json")
    from strategies.runtime.checkpoint import config_from_hf

    return config_from_hf(json.loads((path / "config.json").read_text()), source=str(path))


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scale = cfg.head_dim ** -0.5
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
                ctx_starts: list[int], ctx_lens: list[int], ctx_slots: list[int], ctx_pos0: list[int],
                num_ctx_tokens: int, gen_kmax: int) -> torch.Tensor:
        t = x.size(0)
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Write this step's keys/values first: a token attends to itself and to its slot's history.
        k_cache[token_slots, :, positions] = k  # k_cache: [S, Hkv, max_seq, D]
        v_cache[token_slots, :, positions] = v
        out = torch.empty_like(q)  # [T, H, D]
        for i in range(len(ctx_starts)):
            s, n, slot, p0 = ctx_starts[i], ctx_lens[i], ctx_slots[i], ctx_pos0[i]
            kv_len = p0 + n
            # 4-D views: the batched layout takes PyTorch's fused CPU kernel (2x the 3-D path's speed).
            qi = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_cache[slot, :, :kv_len].unsqueeze(0)  # [1, Hkv, K, D], a view
            vi = v_cache[slot, :, :kv_len].unsqueeze(0)
            if p0 == 0:
                oi = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:  # a later chunk of a chunked prefill: causal with an offset
                qpos = torch.arange(p0, kv_len, device=x.device).unsqueeze(1)  # [n, 1]
                mask = torch.arange(kv_len, device=x.device).unsqueeze(0) <= qpos  # [n, K]
                oi = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            out[s:s + n] = oi[0].transpose(0, 1)
        g = t - num_ctx_tokens
        if g > 0:
            out[num_ctx_tokens:] = self._generation(q[num_ctx_tokens:], k_cache, v_cache, token_slots[num_ctx_tokens:],
                                                    positions[num_ctx_tokens:], gen_kmax)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


    def _generation(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, kmax: int) -> torch.Tensor:
        """One query per request, batched over their slots' caches. When most slots are generating, the
        cache is read in place for every slot (a strided view, no copy) and the rows that matter are
        picked afterwards; otherwise the few slots in use are gathered."""
        g, num_slots = q.size(0), k_cache.size(0)
        qg = q.view(g, self.num_kv_heads, self.group, self.head_dim)  # [G, Hkv, grp, D]
        if 2 * g >= num_slots:
            q_all = torch.zeros((num_slots, self.num_kv_heads, self.group, self.head_dim), dtype=q.dtype,
                                device=q.device)  # [S, Hkv, grp, D]
            q_all[slots] = qg
            pos_all = torch.zeros(num_slots, dtype=positions.dtype, device=q.device)  # idle slots see position 0
            pos_all[slots] = positions
            keys, values, qb, pb = k_cache[:, :, :kmax], v_cache[:, :, :kmax], q_all, pos_all
        else:
            keys, values, qb, pb = k_cache[slots, :, :kmax], v_cache[slots, :, :kmax], qg, positions
        scores = torch.matmul(qb, keys.transpose(-1, -2)) * self.scale  # [B, Hkv, grp, K]
        future = torch.arange(kmax, device=q.device).unsqueeze(0) > pb.unsqueeze(1)  # [B, K]
        scores = scores.masked_fill(future.view(-1, 1, 1, kmax), float("-inf"))
        o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(values.dtype), values)  # [B, Hkv, grp, D]
        if 2 * g >= num_slots:
            o = o[slots]
        return o.reshape(g, self.num_heads, self.head_dim)


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
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
                ctx_starts: list[int], ctx_lens: list[int], ctx_slots: list[int], ctx_pos0: list[int],
                num_ctx_tokens: int, gen_kmax: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, token_slots, positions,
                               ctx_starts, ctx_lens, ctx_slots, ctx_pos0, num_ctx_tokens, gen_kmax)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding → decoder layers → final norm → LM head, evaluated only at the rows that sample."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # RoPE angles in float32 whatever the model dtype, exactly as Hugging Face computes them.
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
                ctx_slots: list[int], ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int,
                sample_rows: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(token_ids)  # [T, hidden]
        freqs = positions.float().unsqueeze(1) * self.inv_freq.float().unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = emb.cos().to(x.dtype).unsqueeze(1)  # [T, 1, D], broadcast over heads
        sin = emb.sin().to(x.dtype).unsqueeze(1)
        layer = 0
        for block in self.layers:
            x = block(x, cos, sin, k_cache[layer], v_cache[layer], token_slots, positions,
                      ctx_starts, ctx_lens, ctx_slots, ctx_pos0, num_ctx_tokens, gen_kmax)
            layer += 1  # noqa: SIM113 - TorchScript indexes the cache by a plain int
        return self.lm_head(self.norm(x[sample_rows]))  # [B, vocab]

    @torch.jit.export
    def step(self, token_ids: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
             ctx_slots: list[int], ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int,
             sample_rows: torch.Tensor, last_token: torch.Tensor, logits_out: torch.Tensor) -> None:
        """The engine's forward as one call: generation inputs are read from the decoder state's
        ``last_token`` on the device, and the logits land in the runtime buffer ``logits_out``."""
        if token_ids.size(0) > num_ctx_tokens:
            token_ids[num_ctx_tokens:] = last_token[token_slots[num_ctx_tokens:]]
        logits = self.forward(token_ids, positions, token_slots, k_cache, v_cache, ctx_starts, ctx_lens, ctx_slots,
                              ctx_pos0, num_ctx_tokens, gen_kmax, sample_rows)
        logits_out[: logits.size(0)].copy_(logits)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> LlamaModel:
    """A model with seeded random weights (no hub access): the same config and seed give the same model."""
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
