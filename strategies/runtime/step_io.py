"""Decoder step inputs and outputs: what one iteration's sampling reads and writes.

Inputs: which slots the output rows belong to, the rows of newly admitted requests whose decoder state
must be reset first, and whether any row needs top-k/top-p/min-p. Outputs: the sampled token and a
finish code per row. Valid for one iteration only, beside the persistent decoder state; a strategy may
hold several sets at once (overlap fills n+1's while the device still writes n's).
"""

from __future__ import annotations

import torch

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.device import DeviceStream
from strategies.runtime.request import Request


class StepIO:
    def __init__(self, max_batch: int, max_stop_ids: int, stream: DeviceStream) -> None:
        self.max_stop_ids = max_stop_ids
        self.host_slots = stream.host_buffer((max_batch,), torch.int64)  # [B] slot of each output row
        self.host_admit = stream.host_buffer((max_batch, 5 + max_stop_ids), torch.int64)  # slot + state ints
        self.host_admit_f = stream.host_buffer((max_batch, 3), torch.float32)  # temperature, top_p, min_p
        self.dev_slots = stream.device_mirror(self.host_slots)
        self.dev_admit = stream.device_mirror(self.host_admit)
        self.dev_admit_f = stream.device_mirror(self.host_admit_f)
        self.dev_out = torch.zeros((2, max_batch), dtype=torch.int64, device=stream.device)  # [2, B] token, code
        self.host_out = stream.host_buffer((2, max_batch), torch.int64)
        self._slots_np = self.host_slots.numpy()
        self._admit_np = self.host_admit.numpy()
        self._admit_f_np = self.host_admit_f.numpy()
        self.rows: list[Request] = []  # the request of each output row, in order
        self.num_admit = 0
        self.use_filters = False
        self.any_random = False

    def fill(self, batch: ScheduledBatch, eos_token_id: int) -> None:
        self.rows = batch.sampled_requests
        for i, r in enumerate(self.rows):
            self._slots_np[i] = r.slot
        self.num_admit = len(batch.admitted)
        for i, r in enumerate(batch.admitted):
            s = r.sampling
            stops = list(s.stop_token_ids) + ([] if s.ignore_eos else [eos_token_id])
            row = self._admit_np[i]
            row[:5] = (r.slot, r.num_output_tokens, r.max_new_tokens, s.seed, s.top_k)
            row[5:] = -1
            row[5:5 + len(stops)] = stops
            self._admit_f_np[i] = (s.temperature, s.top_p, s.min_p)
        self.use_filters = any(r.sampling.uses_filters for r in self.rows)
        self.any_random = any(r.sampling.temperature > 0 for r in self.rows)

    def to_device(self, stream: DeviceStream) -> None:
        stream.copy_prefix(self.dev_slots, self.host_slots, len(self.rows))
        stream.copy_prefix(self.dev_admit, self.host_admit, self.num_admit)
        stream.copy_prefix(self.dev_admit_f, self.host_admit_f, self.num_admit)

    def outputs_to_host(self, stream: DeviceStream) -> None:
        stream.copy_prefix(self.host_out, self.dev_out, len(self.rows), dim=1)

