"""Decoder step inputs and outputs: what one iteration's sampling reads and writes.

Inputs: which slots the output rows belong to, the rows of newly admitted requests whose decoder state
must be reset first, and whether any row needs top-k/top-p/min-p. Outputs: the sampled token and a
finish code per row (``[B, 2]``, so that the rows a step used are one contiguous download). Valid for
one iteration only, beside the persistent decoder state; a strategy may hold several sets at once
(overlap fills n+1's while the device still writes n's).
"""

from __future__ import annotations

import torch

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.memory import DeviceMemory, Mirrored
from strategies.runtime.request import Request

ADMIT_INTS = 5  # slot, tokens generated so far, max new tokens, seed, top_k; then the stop ids


class StepIO:
    def __init__(self, max_batch: int, max_stop_ids: int, memory: DeviceMemory) -> None:
        self.max_stop_ids = max_stop_ids
        self.slots = Mirrored(memory, (max_batch,), torch.int64)  # [B] slot of each output row
        self.admit = Mirrored(memory, (max_batch, ADMIT_INTS + max_stop_ids), torch.int64)  # [A, 5 + K]
        self.admit_f = Mirrored(memory, (max_batch, 3), torch.float32)  # [A, 3] temperature, top_p, min_p
        self.out = Mirrored(memory, (max_batch, 2), torch.int64)  # [B, 2] token, finish code (device → host)
        self.rows: list[Request] = []  # the request of each output row, in order
        self.num_admit = 0
        self.use_filters = False
        self.any_random = False

    def fill(self, batch: ScheduledBatch, eos_token_id: int) -> None:
        self.rows = batch.sampled_requests
        slots = self.slots.np
        for i, r in enumerate(self.rows):
            slots[i] = r.slot
        self.num_admit = len(batch.admitted)
        ints, floats = self.admit.np, self.admit_f.np
        for i, r in enumerate(batch.admitted):
            s = r.sampling
            stops = list(s.stop_token_ids) + ([] if s.ignore_eos else [eos_token_id])
            row = ints[i]
            row[:ADMIT_INTS] = (r.slot, r.num_output_tokens, r.max_new_tokens, s.seed, s.top_k)
            row[ADMIT_INTS:] = -1
            row[ADMIT_INTS:ADMIT_INTS + len(stops)] = stops
            floats[i] = (s.temperature, s.top_p, s.min_p)
        self.use_filters = any(r.sampling.uses_filters for r in self.rows)
        self.any_random = any(r.sampling.temperature > 0 for r in self.rows)

    def upload(self) -> None:
        self.slots.upload(len(self.rows))
        self.admit.upload(self.num_admit)
        self.admit_f.upload(self.num_admit)

    def download(self) -> None:
        self.out.download(len(self.rows))
