"""One pipeline stage's share of a Llama model: a contiguous range of decoder layers, plus the embedding
on the first stage and the final norm and LM head on the last. The layers are ``model.DecoderLayer``
itself, so a stage computes exactly what the whole model computes for those layers."""

from __future__ import annotations

import torch
from torch import nn

from strategies.runtime.kv.paged_attention import attention_indices
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.models.llama import DecoderLayer, RMSNorm, RopeAngles, rope_tables


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n))
        start += n
    return out


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, first_layer: int, end_layer: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        # Modules a stage does not use are 1-row stand-ins (TorchScript wants every attribute typed).
        self.embed_tokens = nn.Embedding(cfg.vocab_size if first else 1, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(first_layer, end_layer)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size if last else 1, bias=False)
        self.rope = RopeAngles(cfg)

    @torch.jit.export
    def step(self, tokens: torch.Tensor, block_table: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
             ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int, tokens_per_block: int,
             sample_rows: torch.Tensor, hidden_in: torch.Tensor, hidden_out: torch.Tensor, k_pools: torch.Tensor,
             v_pools: torch.Tensor, logits_out: torch.Tensor) -> None:
        """tokens [T, 4] as ``LlamaModel.step`` (generation rows carry their input id: the host knows it);
        the first stage embeds, the others read ``hidden_in [T, hidden]``; the last writes the sampled
        rows' logits, the others ``hidden_out``. Pools hold this stage's layers only."""
        positions = tokens[:, 1]
        no_beams = torch.empty((0, 0), dtype=torch.long, device=tokens.device)
        ctx_kv, rows, gen_kv, gen_mask = attention_indices(tokens, block_table, ctx_starts, ctx_lens, ctx_pos0,
                                                           num_ctx_tokens, gen_kmax, tokens_per_block, no_beams, 1,
                                                           k_pools, True)
        x = self.embed_tokens(tokens[:, 0]) if self.first else hidden_in
        cos, sin = rope_tables(positions, self.rope.inv_freq, x.dtype)  # [T, 1, D]
        layer = 0
        for block in self.layers:
            x = block(x, cos, sin, k_pools[layer], v_pools[layer], tokens[:, 3], ctx_starts, ctx_lens, ctx_pos0,
                      ctx_kv, num_ctx_tokens, rows, gen_kv, gen_mask)
            layer += 1  # noqa: SIM113 - TorchScript indexes the pools by a plain int
        if self.last:
            logits = self.lm_head(self.norm(x[sample_rows]))  # [B, vocab]
            logits_out[: logits.size(0)].copy_(logits)
        else:
            hidden_out.copy_(x)


def stage_state(full: dict[str, torch.Tensor], first_layer: int, end_layer: int, first: bool,
                last: bool) -> dict[str, torch.Tensor]:
    """A stage's entries of a whole model's state dict, its layers renumbered from 0."""
    out = {}
    for name, t in full.items():
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            if first_layer <= int(i) < end_layer:
                out[f"layers.{int(i) - first_layer}.{rest}"] = t
        elif (name.startswith("embed_tokens.") and first) or (name.split(".")[0] in ("norm", "lm_head") and last):
            out[name] = t
    return out
