"""Encoder buffers: what an encoder–decoder step adds to a buffer set, and the per-request encoder output.

One set per in-flight step, like the runtime buffers. The encoder's own engine inputs and outputs: the
newly admitted requests' encoder tokens packed like context tokens (id, position) with each request's
segment, and ``output [E, hidden]`` (device only), where the ``encode`` piece leaves each request's last
hidden states in its segment — the per-request encoder output. The decoder's cross-attention inputs:
which output rows the decoder projects into which cross-KV pages in this step (the requests' first
decoder step, the one that admitted them), and each request row's cross block-table row and encoder
length. After that step the encoder output is never read again: generation reads cross KV only.
TensorRT-LLM's arrangement is the same: the encoder engine has its own input/output buffers
(``EncoderBuffers``), a request carries its encoder output to the decoder, and the decoder's context
step turns it into the cross KV cache (its own pool, ``cross_kv``, with its own block manager).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.family import EngineSizes, StepFill
from strategies.runtime.buffers.mirrored import Memory, Mirrored

if TYPE_CHECKING:
    import torch

    from strategies.runtime.models.config import ModelConfig

ID, POSITION = range(2)  # columns of ``tokens``


class EncoderBuffers:
    name = "encoder"  # a buffer family (buffers/family.py)
    HOST_STATE = ("starts", "lens", "cross_lens", "num_tokens", "num_fill", "table_shape")  # as RuntimeBuffers'

    def __init__(self, max_tokens: int, max_rows: int, max_len: int, hidden: int, dtype: str,
                 tokens_per_block: int, memory: Memory) -> None:
        max_blocks = -(-max_len // tokens_per_block)
        self.tokens_per_block = tokens_per_block
        self.tokens = Mirrored(memory, (max_tokens, 2), "int64")  # [E, 2] id, position
        self.output = memory.zeros((max_tokens, hidden), dtype)  # [E, hidden] each request's encoder output
        self.fill = Mirrored(memory, (max_tokens,), "int64")  # [F] cross page of each output row
        self.cross_table = Mirrored(memory, (max_rows * max_blocks,), "int64")  # [R * Wc] viewed [R, Wc]
        # [R] encoder length of each request row, for the generation rows' cross-attention mask: staged like
        # every other step input (a list turned into a tensor inside the step is a blocking copy on CUDA)
        self.cross_len = Mirrored(memory, (max_rows,), "int64")
        self._arange = np.arange(max_len, dtype=np.int64)
        self.starts: list[int] = []  # host ints: the encoder's segments (they shape its kernels)
        self.lens: list[int] = []
        # encoder length of each request row of the step, block-table order: host ints (a context chunk's
        # shape their kernels), and ``cross_len`` on the device
        self.cross_lens: list[int] = []
        self.num_tokens = self.num_fill = 0
        self.table_shape = (0, 0)

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: EngineSizes, memory: Memory, shared: dict) -> EncoderBuffers | None:
        if not cfg.is_encoder_decoder:  # (filled on every device, the simulated one included)
            return None
        return cls(sizes.max_tokens, sizes.max_batch, sizes.max_seq_len, cfg.hidden_size, cfg.dtype,
                   sizes.tokens_per_block, memory)

    def fill_step(self, f: StepFill) -> None:
        assert f.cross_table is not None, "an encoder–decoder step has a cross-attention block table"
        self.fill_encoder(f.batch, f.cross_table)

    def fill_encoder(self, batch: ScheduledBatch, cross_table: np.ndarray) -> None:
        """Encoder inputs of ``batch.admitted``; cross inputs for every request row of the step."""
        tok, fill, tpb = self.tokens.np, self.fill.np, self.tokens_per_block
        self.starts, self.lens = [], []
        off = 0
        for r in batch.admitted:  # encoded at admission (again after a preemption: recomputed)
            n = r.encoder_len
            pos = self._arange[:n]
            tok[off:off + n, ID] = r.encoder_prompt_token_ids
            tok[off:off + n, POSITION] = pos
            # projected into cross KV by the decoder in this same step, its first
            fill[off:off + n] = cross_table[r.slot, pos // tpb] * tpb + pos % tpb
            self.starts.append(off)
            self.lens.append(n)
            off += n
        self.num_tokens = self.num_fill = off
        reqs = [c.request for c in batch.context] + batch.gen_requests
        self.cross_lens = [r.encoder_len for r in reqs]
        self.cross_len.np[:len(reqs)] = self.cross_lens
        width = -(-max(self.cross_lens, default=0) // tpb)
        self.table_shape = (len(reqs), width)
        slots = [r.slot for r in reqs]
        self.cross_table.np[:len(reqs) * width].reshape(len(reqs), width)[:] = cross_table[slots, :width]

    def upload_encoder(self) -> None:
        """In the ``encode`` piece, which runs before the forward."""
        self.tokens.upload(self.num_tokens)

    def upload(self) -> None:
        """In the forward: the decoder's cross-attention inputs."""
        self.fill.upload(self.num_fill)
        self.cross_table.upload(self.table_shape[0] * self.table_shape[1])
        self.cross_len.upload(len(self.cross_lens))

    def download(self) -> None:
        """Nothing comes back: the encoder output stays on the device."""

    def device_cross_table(self) -> torch.Tensor:
        r, w = self.table_shape
        return self.cross_table.dev[:r * w].view(r, w)  # [R, Wc]
