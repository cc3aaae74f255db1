"""A mixture-of-experts MLP (Mixtral's sparse block) over a packed token batch, as Hugging Face computes it.

A router (one linear layer, hidden -> experts) scores every token; the softmax is taken in float32, the
``top_k`` best experts kept and their weights renormalised to sum to 1 (``MixtralTopKRouter``). Each
expert is a SwiGLU MLP (w1 gate, w3 up, w2 down). Each token's weight for every expert is scattered into a
[T, E] table (0 where the token did not choose the expert), each expert runs over every row of the step, and its
rows, scaled by their weights, are added into the output in expert order — the order HF's ``MixtralExperts``
adds them in; an unchosen expert adds exact zeros (selected, not multiplied: an overflow there stays out). In
float64 the tokens equal HF's (tests/test_moe.py); in half precision a GEMM's rows may round differently at
another row count, as between any two batch sizes. Nothing here reads a device value on the host: HF's (and this
module's earlier) per-expert ``nonzero()`` made a step's shapes depend on the routing, a host sync per expert
and layer on CUDA (256 a Mixtral forward) and no CUDA graph. The price is compute: every expert runs on every
row, E/k times the routed work (vLLM's fused kernels run only the routed rows: the simulated device prices
those, ``sim/published/fused_moe.py``); this engine is the reference the strategies share, not a fast MoE.
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
        table = torch.zeros_like(probs).scatter_(1, chosen, weights)  # [T, E] float32, 0 where not chosen
        out = torch.zeros_like(x)  # [T, hidden]
        e = 0
        for expert in self.experts:
            w = table[:, e].unsqueeze(1)  # [T, 1]
            # a row not routed here adds exact zeros, even where this expert's output overflowed (inf x 0 = NaN)
            y = torch.where(w > 0, expert(x) * w, torch.zeros((), dtype=w.dtype))  # [T, hidden]: float32 promotes
            out = out + y.to(out.dtype)
            e += 1  # noqa: SIM113 - TorchScript iterates a ModuleList without enumerate's index
        return out
