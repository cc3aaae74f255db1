"""The engine on the simulated device: real buffers, decoder state and sampler; a stand-in forward."""

from __future__ import annotations

import numpy as np
import torch

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.buffers.encoder_buffers import EncoderBuffers
from strategies.runtime.device.stream import DeviceWork
from strategies.runtime.engine import Engine
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.sim.cost import CostModel

SIM_VOCAB = 512
SAMPLE_FRACTION = 0.02  # share of a step's time shown as "sample" in the records


def proxy_config(spec: ModelConfig) -> ModelConfig:
    """What the host-side buffers are sized for: a small vocabulary, the spec's context length, and its
    family (an encoder–decoder spec gets encoder buffers and a cross-KV block manager)."""
    family = {"architecture": "bart", "encoder_layers": 1} if spec.is_encoder_decoder else {}
    return ModelConfig(vocab_size=SIM_VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, intermediate_size=8,
                       max_position_embeddings=spec.max_position_embeddings, eos_token_id=2, **family)


class SimModel(torch.nn.Module):
    """Deterministic, cheap logits: a peak at a hash of (input token, position). No KV is kept."""

    def step(self, tokens: torch.Tensor, block_table: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
             ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int, tokens_per_block: int,
             sample_rows: torch.Tensor, last_token: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor,
             logits_out: torch.Tensor, cache_indirection: torch.Tensor, max_beam: int) -> None:
        token_ids, positions = tokens[:, 0], tokens[:, 1]
        if token_ids.size(0) > num_ctx_tokens:
            token_ids[num_ctx_tokens:] = last_token[tokens[num_ctx_tokens:, 2]]
        b = sample_rows.size(0)
        peak = (token_ids[sample_rows] * 1103 + positions[sample_rows] * 2654435 + 12345) % logits_out.size(1)  # [B]
        out = logits_out[:b]
        out.zero_()
        out.scatter_(1, peak.unsqueeze(1), 8.0)


def _nothing() -> None:
    """The simulated encode piece: priced by the cost model, nothing to compute."""


class SimEngine(Engine):
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, stream, *, cost: CostModel, stages: int = 1,
                 **kwargs) -> None:
        self.cost_model = cost
        self.stages = stages  # pipeline stages the simulated device is split into
        super().__init__(cfg, SimModel(), stream, **kwargs)
        if cfg.is_encoder_decoder:  # the host fills encoder buffers as on a real device; nothing computes them
            for bufs in self.buffer_sets:
                bufs.encoder = EncoderBuffers(kwargs["max_tokens"], kwargs["max_batch"], kwargs["max_seq_len"],
                                              cfg.hidden_size, cfg.torch_dtype, kwargs["tokens_per_block"],
                                              stream.memory)

    def _kv_storage(self, num_blocks: int, tokens_per_block: int) -> None:
        return None  # nothing to store: the forward is not computed (blocks are still managed and counted)

    def prepare(self, batch: ScheduledBatch, bufs: BufferSet, block_table: np.ndarray,
                cross_table: np.ndarray | None = None) -> None:
        super().prepare(batch, bufs, block_table)
        if bufs.encoder is not None and cross_table is not None:
            bufs.encoder.fill_step(batch, cross_table)

    def launch(self, iteration: int, bufs: BufferSet) -> DeviceWork:
        if self.stages > 1:  # pipeline parallelism: the stream times each stage
            stage_s, hop_s = self.cost_model.stage_times(bufs.work, self.stages)
            durations = {"sample": stage_s[-1] * SAMPLE_FRACTION}
            return self.stream.enqueue(iteration, [("forward", self._forward, (iteration, bufs)),
                                                   ("sample", self._sample, (bufs,))], durations,
                                       stage_s=stage_s, hop_s=hop_s)
        phases = self.cost_model.phases(bufs.work)
        encode = phases.pop("encoder", 0.0)
        total = sum(phases.values())
        durations = {"forward": total * (1 - SAMPLE_FRACTION), "sample": total * SAMPLE_FRACTION}
        pieces = [("forward", self._forward, (iteration, bufs)), ("sample", self._sample, (bufs,))]
        if encode:
            durations["encode"] = encode
            pieces.insert(0, ("encode", _nothing, ()))
        return self.stream.enqueue(iteration, pieces, durations)
