"""The engine on the simulated device: the host's real buffers, filled and "uploaded" as on any device; a
device side that only prices the step (the cost model) and writes each row a token and finish code by a
cheap rule (``sim/decoder.py``) — no forward, no sampler, no KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.batch import BatchWork
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.buffers.family import MAX_STOP_IDS
from strategies.runtime.device.stream import DeviceWork
from strategies.runtime.engine import Engine
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request
from strategies.runtime.sim.cost import CostModel
from strategies.runtime.sim.decoder import SimDecoder

if TYPE_CHECKING:
    import torch

SIM_VOCAB = 512  # the simulated decoder's tokens are drawn from [0, SIM_VOCAB) (sim/decoder.py)
SAMPLE_FRACTION = 0.02  # share of a step's time shown as "sample" in the records


def proxy_config(spec: ModelConfig) -> ModelConfig:
    """What the host-side buffers are sized for: the spec's vocabulary (a prompt of any id below it is
    accepted: a real tokenised trace replays), its context length, and its family (an encoder–decoder spec
    gets encoder buffers and a cross-KV block manager). The logits buffer this sizes is never written on
    the simulated device, and its zeros are never touched (``SimMemory.zeros``)."""
    family = {"architecture": "bart", "encoder_layers": 1} if spec.is_encoder_decoder else {}
    return ModelConfig(vocab_size=spec.vocab_size, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, intermediate_size=8,
                       max_position_embeddings=spec.max_position_embeddings, eos_token_id=2, **family)


def _nothing() -> None:
    """The simulated encode piece: priced by the cost model, nothing to compute."""


class SimEngine(Engine):
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module | None, stream, *, cost: CostModel, stages: int = 1,
                 acceptance_rate: float = 0.0, draft_cost: CostModel | None = None, **kwargs) -> None:
        self.cost_model = cost
        self.draft_cost = draft_cost  # speculative decoding with a draft model: the draft's cost model
        self.acceptance_rate = acceptance_rate  # speculative decoding: the forced acceptance (sim/decoder.py)
        self.stages = stages  # pipeline stages the simulated device is split into
        super().__init__(cfg, None, stream, **kwargs)  # no weights: nothing is computed

    def _kv_storage(self, num_blocks: int, tokens_per_block: int) -> None:
        return None  # nothing to store: the forward is not computed (blocks are still managed and counted)

    def _decoder_state(self, num_slots: int, max_beam: int, max_seq_len: int) -> SimDecoder:  # type: ignore[override]
        return SimDecoder(num_slots, MAX_STOP_IDS, min(SIM_VOCAB, self.cfg.vocab_size))

    def _forward(self, iteration: int, bufs: BufferSet) -> None:
        self._check_fault(iteration)
        io = bufs.step
        bufs.upload()  # as on a device (the simulated device's memory is the host's: no copies)
        if io.num_admit:  # the simulated device's memory is the host's: its buffers' numpy views are its own
            self.state.admit(io.admit.np[:io.num_admit])

    def _sample(self, bufs: BufferSet) -> None:
        io = bufs.step
        self.state.step(io.slots.np[:io.num_rows], io.out.np[:io.num_rows])
        d = bufs.drafts
        if d is not None and d.num_rows:
            self.state.accept(d.slots.np[:d.num_rows], d.num_drafts.np[:d.num_rows], self.acceptance_rate,
                              d.out.np[:d.num_rows])
        bufs.download()

    def _draft_s(self, bufs: BufferSet) -> float:
        """A draft model's passes before the verifying forward (in the forward piece's time), as the draft
        engine runs them (``spec/draft_model.py``): pass 1 feeds each row the tokens the draft holds no keys
        for — at a request's first verification its whole prompt, later the target's last token and the
        accepted drafts it never fed — as a context chunk; pass j > 1 decodes one token for every row that
        proposes j or more drafts. Each row's draft keys then reach its last draft, as the engine's do (the
        accept step rewinds them to what was accepted: ``speculation.receive_verified``)."""
        d = bufs.drafts
        if self.draft_cost is None or d is None or not d.num_rows:
            return 0.0
        ks = d.num_drafts.np[:d.num_rows]
        positions = np.asarray(d.positions)  # [R] each row's last sampled token's position
        starts = np.minimum([r.draft_computed for r in d.rows], positions)  # [R] the draft's first unseen one
        fed = positions + 1 - starts  # [R] tokens pass 1 feeds
        kv, pairs = int((positions + 1).sum()), int((fed * starts + fed * (fed + 1) // 2).sum())
        n, rows = int(fed.sum()), len(fed)
        total = sum(self.draft_cost.phases(BatchWork(n, rows, kv, pairs, n, kv, pairs, rows)).values())
        for j in range(1, int(ks.max())):
            more = ks > j
            m, kv = int(more.sum()), int((positions[more] + 1 + j).sum())
            total += sum(self.draft_cost.phases(BatchWork(m, m, kv, kv)).values())
        for r, p, k in zip(d.rows, positions.tolist(), ks.tolist(), strict=True):
            r.draft_computed = p + k
        return total

    def read_beams(self, iteration: int, requests: list[Request]) -> list[list[tuple[list[int], float]]]:
        """No beams were searched: each returned sequence is the one token per step the device wrote."""
        return [[(r.output_token_ids, 0.0)] * r.sampling.num_return_sequences for r in requests]

    @property
    def kv_block_bytes(self) -> int:
        return int(self.cost_model.kv_bytes_per_token) * self.tokens_per_block  # the simulated model's, not the proxy's

    def _copy_s(self, bufs: BufferSet) -> dict[str, float]:
        """The host KV tier's copies priced over the host link: offloads, then onloads (``kv/host_pool.py``)."""
        c = bufs.kv_copies
        if c is None or not c.any:
            return {}
        return {"kv_host_copy": self.cost_model.host_copy_s(c.num_offload + c.num_onload, self.tokens_per_block,
                                                            self.stages)}

    def launch(self, iteration: int, bufs: BufferSet) -> DeviceWork:
        copies = self.copy_pieces(bufs)
        if self.stages > 1:  # pipeline parallelism: the stream times each stage
            stage_s, hop_s = self.cost_model.stage_times(bufs.work, self.stages)
            durations = {"sample": stage_s[-1] * SAMPLE_FRACTION, **self._copy_s(bufs)}
            return self.stream.enqueue(iteration, [*copies, ("forward", self._forward, (iteration, bufs)),
                                                   ("sample", self._sample, (bufs,))], durations,
                                       stage_s=stage_s, hop_s=hop_s)
        phases = self.cost_model.phases(bufs.work)
        encode = phases.pop("encoder", 0.0)
        total = sum(phases.values()) + self._draft_s(bufs)
        durations = {"forward": total * (1 - SAMPLE_FRACTION), "sample": total * SAMPLE_FRACTION, **self._copy_s(bufs)}
        pieces = [("forward", self._forward, (iteration, bufs)), ("sample", self._sample, (bufs,))]
        if encode:
            durations["encode"] = encode
            pieces.insert(0, ("encode", _nothing, ()))
        pieces[:0] = copies  # (first: the copy engine's, ``sim/device.py``)
        return self.stream.enqueue(iteration, pieces, durations)
