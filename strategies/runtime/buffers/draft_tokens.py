"""Draft-token buffers (speculative decoding): one step's verifying rows, their drafts, and what the
accept step made of them.

Host → device: each verifying request's slot, its drafts ``[R, K]`` (a row with fewer than K pads with
-1, never a token) and how many it has. Device → host: per row the K + 1 target tokens, how many the
request received, its finish code and how many of its drafts it received (``[R, K + 4]``, one
contiguous download). The drafts themselves also enter the step's packed tokens (RuntimeBuffers), after
the row's last sampled token, as one chunk; these buffers are what the accept step reads beside the
logits. One set per buffer set, like the decoder step I/O (docs/buffers.md: TensorRT-LLM keeps them in
its decoder's input and output buffers, vLLM in ``SpecDecodeMetadata``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.batch import VerifyStep
from strategies.runtime.buffers.family import EngineSizes, StepFill
from strategies.runtime.buffers.mirrored import Memory, Mirrored
from strategies.runtime.buffers.step_io import modes_in_use, shared_slot_modes
from strategies.runtime.request import Request

if TYPE_CHECKING:
    from strategies.runtime.models.config import ModelConfig


class DraftTokens:
    name = "drafts"  # a buffer family (buffers/family.py)
    HOST_STATE = ("num_rows", "use_filters", "any_random")  # as RuntimeBuffers'

    def __init__(self, max_batch: int, max_drafts: int, memory: Memory) -> None:
        self.k = max_drafts
        self.slots = Mirrored(memory, (max_batch,), "int64")  # [R] slot of each verifying request
        self.drafts = Mirrored(memory, (max_batch, max_drafts), "int64")  # [R, K] -1 past a row's drafts
        self.num_drafts = Mirrored(memory, (max_batch,), "int64")  # [R]
        # [R, K + 4] K + 1 target tokens, tokens received, finish code, drafts received (device → host)
        self.out = Mirrored(memory, (max_batch, max_drafts + 4), "int64")
        self.rows: list[Request] = []  # the request of each row, in order (host only)
        self.positions: list[int] = []  # each row's first position (its last sampled token's), host only
        self.num_rows = 0
        self.use_filters = False  # some row uses top-k/top-p/min-p (StepIO's flags, for these rows)
        self.any_random = False  # some row samples at random
        self.slot_modes = np.zeros((0, 2), dtype=bool)  # [S, 2] the decoder step I/O's (``build`` shares them)

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: EngineSizes, memory: Memory, shared: dict) -> DraftTokens | None:
        if not sizes.max_drafts:  # no speculative decoding
            return None
        d = cls(sizes.max_batch, sizes.max_drafts, memory)
        d.slot_modes = shared_slot_modes(sizes, shared)
        return d

    def fill_step(self, f: StepFill) -> None:
        self.fill(f.batch.verify, self.slot_modes)

    def fill(self, steps: list[VerifyStep], slot_modes: np.ndarray) -> None:
        """``slot_modes [S, 2]``: StepIO's per-slot (uses filters, samples at random), set at admission."""
        self.rows = [v.request for v in steps]
        self.positions = [v.position for v in steps]
        self.num_rows = n = len(steps)
        drafts = self.drafts.np
        drafts[:n] = -1
        for i, v in enumerate(steps):
            self.slots.np[i] = v.request.slot
            self.num_drafts.np[i] = len(v.drafts)
            drafts[i, :len(v.drafts)] = v.drafts
        self.use_filters, self.any_random = modes_in_use(slot_modes, self.slots.np[:n])

    def upload(self) -> None:
        for m in (self.slots, self.drafts, self.num_drafts):
            m.upload(self.num_rows)

    def download(self) -> None:
        self.out.download(self.num_rows)
