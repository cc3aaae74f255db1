"""A mixture-of-experts MLP (Mixtral's sparse block) over a packed token batch, as Hugging Face computes it.

A router (one linear layer, hidden -> experts) scores every token; the softmax is taken in float32, the
``top_k`` best experts kept and their weights renormalised to sum to 1 (``MixtralTopKRouter``). Each
expert is a SwiGLU MLP (w1 gate, w3 up, w2 down). The step's per-expert token lists — which rows of the
batch each expert takes, and at which of their k places — are built from the routing, each expert runs
its rows, scales them by their weights and adds them into the output in expert order, as HF's
``MixtralExperts`` does, so float64 outputs agree bit for bit. Experts no token chose are not run.
"""

from __future__ import annotations

import torch
from torch import nn

from strategies.runtime.models.config import ModelConfig


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # down
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)  # the router
        self.experts = nn.ModuleList([Expert(cfg) for _ in range(cfg.num_local_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E] float32, as HF routes
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [T, k] float32
        out = torch.zeros_like(x)  # [T, hidden]
        e = 0
        for expert in self.experts:
            rows = (chosen == e).nonzero()  # [N, 2]: (token, its place among the token's k) for expert e
            e += 1  # noqa: SIM113 - TorchScript iterates a ModuleList without enumerate's index
            if rows.size(0) > 0:  # (TorchScript unrolls this loop: no continue)
                token, place = rows[:, 0], rows[:, 1]  # [N] each
                y = expert(x[token]) * weights[token, place].unsqueeze(1)  # [N, hidden]: float32 weights promote
                out.index_add_(0, token, y.to(out.dtype))
        return out
