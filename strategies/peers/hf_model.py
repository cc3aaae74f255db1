"""The same weights as a Hugging Face ``LlamaForCausalLM``, so peers and slotbench run one checkpoint."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from strategies.interface import Executor, RequestSource
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request


def to_hf(cfg: ModelConfig, model: torch.nn.Module) -> LlamaForCausalLM:
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
                         rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                         eos_token_id=cfg.eos_token_id, pad_token_id=0, bos_token_id=None)
    hf = LlamaForCausalLM(hf_cfg)
    state = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in model.state_dict().items()
             if not k.endswith("inv_freq")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    return hf.to(dtype=cfg.torch_dtype).eval()


class PeerExecutor(Executor):
    """Shared by the peers: greedy only (their samplers differ from slotbench's), and no preemption."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hf = to_hf(self.model_cfg, self.model)

    def rejection(self, r: Request) -> str | None:
        if r.sampling.temperature > 0:
            return f"{self.name} runs greedy only (its sampler is not slotbench's)"
        if r.sampling.stop_token_ids:
            return f"{self.name} takes no per-request stop ids"
        if r.width > 1:
            return f"{self.name} runs no beam search"
        return super().rejection(r)

    def arrivals(self, source: RequestSource) -> list[Request]:
        """Requests that arrived since the last call and can be served; the others are rejected."""
        accepted = []
        for r in source.poll(self.clock.now()):
            reason = self.rejection(r)
            if reason is None:
                accepted.append(r)
            else:
                self._reject(r, reason)
        return accepted

    def idle_until_arrival(self, source: RequestSource) -> bool:
        """Nothing in flight: sleep until the next arrival; False when none will come."""
        nxt = source.next_arrival_s()
        if nxt is None:
            return False
        self.clock.sleep_until(nxt)
        return True

    def eos_for(self, r: Request) -> int:
        return -1 if r.sampling.ignore_eos else self.model_cfg.eos_token_id
