"""Runtime buffers: the engine's inputs and outputs for one forward.

Token ids, positions and slot ids of every token in the packed batch, the rows whose hidden state is
sampled, and the logits of those rows. Allocated once at the maximum sizes (pinned on the host when the
device is CUDA); each iteration writes a prefix and the engine reads views of it. A buffer set is owned
by one in-flight step from prepare until its outputs are read, which is why overlap keeps two.
"""

from __future__ import annotations

import numpy as np
import torch

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.device import DeviceStream


class RuntimeBuffers:
    def __init__(self, max_tokens: int, max_batch: int, max_seq_len: int, vocab_size: int,
                 stream: DeviceStream, logits_dtype: torch.dtype) -> None:
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.host = stream.host_buffer((3, max_tokens), torch.int64)  # [3, T] ids, positions, slots
        self.host_rows = stream.host_buffer((max_batch,), torch.int64)  # [B] packed row of each sample
        self.dev = stream.device_mirror(self.host)
        self.dev_rows = stream.device_mirror(self.host_rows)
        self.logits = torch.empty((max_batch, vocab_size), dtype=logits_dtype, device=stream.device)  # [B, V]
        self._np = self.host.numpy()
        self._rows_np = self.host_rows.numpy()
        self._arange = np.arange(max_seq_len, dtype=np.int64)
        # Segment metadata travels as host ints: the context loop needs them to shape its kernels.
        self.ctx_starts: list[int] = []
        self.ctx_lens: list[int] = []
        self.ctx_slots: list[int] = []
        self.ctx_pos0: list[int] = []
        self.num_tokens = 0
        self.num_ctx_tokens = 0
        self.num_samples = 0
        self.gen_kmax = 0

    def fill(self, batch: ScheduledBatch) -> None:
        """Write the batch's tokens into the host side; generation inputs stay on the device."""
        ids, pos, slots = self._np
        if batch.num_tokens > self.max_tokens:
            raise ValueError(f"batch of {batch.num_tokens} tokens exceeds the buffers' {self.max_tokens}")
        self.ctx_starts, self.ctx_lens, self.ctx_slots, self.ctx_pos0 = [], [], [], []
        off = rows = 0
        for c in batch.context:
            r = c.request
            n = c.length + c.padding
            ids[off:off + c.length] = r.token_ids[c.start:c.start + c.length]
            ids[off + c.length:off + n] = 0
            pos[off:off + n] = self._arange[c.start:c.start + n]
            slots[off:off + n] = r.slot
            self.ctx_starts.append(off)
            self.ctx_lens.append(n)
            self.ctx_slots.append(r.slot)
            self.ctx_pos0.append(c.start)
            if c.samples:
                self._rows_np[rows] = off + c.length - 1
                rows += 1
            off += n
        self.num_ctx_tokens = off
        kmax = 0
        for g in batch.generation:
            ids[off] = 0  # replaced on the device by the slot's last sampled token
            pos[off] = g.position
            slots[off] = g.request.slot
            kmax = max(kmax, g.position + 1)
            self._rows_np[rows] = off
            rows += 1
            off += 1
        self.num_tokens, self.num_samples, self.gen_kmax = off, rows, kmax

    def to_device(self, stream: DeviceStream) -> None:
        stream.copy_prefix(self.dev, self.host, self.num_tokens)
        stream.copy_prefix(self.dev_rows, self.host_rows, self.num_samples)
