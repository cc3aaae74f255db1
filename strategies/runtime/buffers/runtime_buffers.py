"""Runtime buffers: the engine's inputs and outputs for one forward.

Per token of the packed batch: its id, position, slot and the KV page it writes; per request in the
step: its row of the block table (the pages attention reads); per sampled row: which packed token it
is; and the logits of those rows (float32 on the device, whatever the model dtype, as Hugging Face
samples). Allocated once at the maximum sizes; each iteration writes a prefix on the host and the
device stream uploads exactly that prefix (``memory.Mirrored``). A buffer set is owned by one
in-flight step from prepare until its outputs are read, which is why overlap keeps two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.family import EngineSizes, StepFill
from strategies.runtime.buffers.mirrored import Memory, Mirrored
from strategies.runtime.request import Request

if TYPE_CHECKING:
    import torch

    from strategies.runtime.models.config import ModelConfig

ID, POSITION, SLOT, PAGE = range(4)  # columns of ``tokens``


class RuntimeBuffers:
    name = "runtime"  # a buffer family (buffers/family.py)
    # What a step's device pieces read besides the tensors: host ints set by ``fill`` (a device in another
    # process receives them with each step: buffers/buffer_set.py)
    HOST_STATE = ("ctx_starts", "ctx_lens", "ctx_pos0", "num_tokens", "num_ctx_tokens", "num_samples", "gen_kmax",
                  "table_shape")

    def __init__(self, max_tokens: int, max_batch: int, max_seq_len: int, tokens_per_block: int, vocab_size: int,
                 memory: Memory, max_drafts: int = 0) -> None:
        max_blocks_per_seq = -(-max_seq_len // tokens_per_block)
        self.max_tokens = max_tokens
        self.max_drafts = max_drafts  # speculative decoding's K: a verifying request samples K + 1 rows
        max_rows = max_batch * (1 + max_drafts)
        self.tokens = Mirrored(memory, (max_tokens, 4), "int64")  # [T, 4] id, position, slot, page
        self.rows = Mirrored(memory, (max_rows,), "int64")  # [B] packed token of each sampled row
        # [R * W] flat, viewed as [R, W] for the step's R requests and W widest row, so that the upload
        # is one contiguous prefix however wide this step's rows are.
        self.block_table = Mirrored(memory, (max_batch * max_blocks_per_seq,), "int64")
        self.logits = memory.zeros((max_rows, vocab_size), "float32")  # [B, V]
        self.tokens_per_block = tokens_per_block
        self._arange = np.arange(max(max_seq_len, max_tokens), dtype=np.int64)  # positions; packed rows
        # Segment metadata travels as host ints: the context loop needs them to shape its kernels.
        self.ctx_starts: list[int] = []
        self.ctx_lens: list[int] = []
        self.ctx_pos0: list[int] = []
        self.num_tokens = 0
        self.num_ctx_tokens = 0
        self.num_samples = 0
        self.gen_kmax = 0
        self.table_shape = (0, 0)

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: EngineSizes, memory: Memory, shared: dict) -> RuntimeBuffers:
        return cls(sizes.max_tokens, sizes.max_batch, sizes.max_seq_len, sizes.tokens_per_block, cfg.vocab_size, memory,
                   sizes.max_drafts)

    def fill_step(self, f: StepFill) -> None:
        self.fill(f.batch, f.block_table, f.order)

    def fill(self, batch: ScheduledBatch, tables: np.ndarray, order: list[Request]) -> None:
        """Write the batch into the host side. ``tables [S, Kb, MB]``: the block manager's block tables
        (one row per beam of each slot); ``order``: the requests in the step's output order. A beam
        request's generation step is one token per beam, adjacent; a sampling context chunk feeds all
        its beams' first rows. Generation inputs stay on the device (the decoder state's last tokens)."""
        if batch.num_tokens > self.max_tokens:
            raise ValueError(f"batch of {batch.num_tokens} tokens exceeds the buffers' {self.max_tokens}")
        tok, rows, tokens_per_block = self.tokens.np, self.rows.np, self.tokens_per_block
        kb = tables.shape[1]
        beams = kb > 1
        table = tables.reshape(-1, tables.shape[2])  # [S * Kb, MB] a view: row slot * Kb + beam
        self.ctx_starts, self.ctx_lens, self.ctx_pos0 = [], [], []
        slots: list[int] | np.ndarray = []  # the table row (slot * Kb + beam) of each context row, in step order
        # beams: id(request) → (packed index of its first sampled token, 0 if every beam samples that one
        # token (a context chunk's last) else 1 (one token per beam))
        sampled_at: dict[int, tuple[int, int]] = {}
        off = num_rows = width = 0
        for c in batch.context:
            r, n = c.request, c.length + c.padding
            pos = self._arange[c.start:c.start + n]
            tok[off:off + c.length, ID] = r.token_ids[c.start:c.start + c.length]
            tok[off + c.length:off + n, ID] = 0
            tok[off:off + n, POSITION] = pos
            row0 = r.slot * kb
            tok[off:off + n, SLOT] = row0
            # each block's first page, then the pages within it, cut to the chunk (not a block lookup per token:
            # docs/host-path.md)
            b0 = c.start // tokens_per_block
            pages = table[row0, b0:-(-(c.start + n) // tokens_per_block), None] * tokens_per_block \
                + self._arange[:tokens_per_block]  # [blocks, tpb]
            tok[off:off + n, PAGE] = pages.ravel()[c.start - b0 * tokens_per_block:][:n]
            self.ctx_starts.append(off)
            self.ctx_lens.append(n)
            self.ctx_pos0.append(c.start)
            slots.append(row0)
            width = max(width, -(-(c.start + n) // tokens_per_block))
            if c.samples:
                if beams:
                    sampled_at[id(r)] = (off + c.length - 1, 0)
                else:
                    rows[num_rows] = off + c.length - 1
                    num_rows += 1
            off += n
        verify_rows, verify_width = self._fill_verify(batch, table, off, slots) if batch.verify else (None, 0)
        off += batch.num_verify_tokens
        self.num_ctx_tokens = off
        gen = batch.gen_requests
        g = len(gen)
        kmax = 0
        if g:
            gen_slots = batch.gen_slots if batch.gen_slots is not None else \
                np.array([r.slot for r in gen], dtype=np.int64)  # [G]
            gen_pos = batch.gen_position_array if batch.gen_position_array is not None else \
                np.array(batch.gen_positions, dtype=np.int64)  # [G]
            if beams:  # one row per beam: repeat each request's slot and position, number its beams
                widths = np.array([r.width for r in gen], dtype=np.int64)  # [G]
                first = np.cumsum(widths) - widths
                for r, at in zip(gen, first.tolist(), strict=True):
                    sampled_at[id(r)] = (off + at, 1)
                gen_beam = np.arange(widths.sum()) - np.repeat(first, widths)
                gen_slots = np.repeat(gen_slots, widths) * kb + gen_beam  # table rows
                gen_pos = np.repeat(gen_pos, widths)
                g = len(gen_slots)
            end = off + g
            tok[off:end, ID] = 0  # replaced on the device by the beam row's last sampled token
            tok[off:end, POSITION] = gen_pos
            tok[off:end, SLOT] = gen_slots
            block, within = np.divmod(gen_pos, tokens_per_block)  # [G] each
            tok[off:end, PAGE] = table[gen_slots, block] * tokens_per_block + within
            if not beams:
                rows[num_rows:num_rows + g] = self._arange[off:end]
                num_rows += g
            kmax = int(gen_pos.max()) + 1
            width = max(width, -(-kmax // tokens_per_block))
        if beams:  # output rows in ``order``: a context sampler's row repeated per beam, a step's beams in turn
            for r in order:
                at, stride = sampled_at[id(r)]
                rows[num_rows:num_rows + r.width] = at + stride * self._arange[:r.width]
                num_rows += r.width
        if verify_rows is not None:  # after every other request's rows, K + 1 a request (the accept step's layout)
            rows[num_rows:num_rows + len(verify_rows)] = verify_rows
            num_rows += len(verify_rows)
            width = max(width, verify_width)
        self.num_tokens, self.num_samples, self.gen_kmax = off + g, num_rows, kmax
        if g:  # the table rows of every request row, in step order
            slots = np.concatenate((np.array(slots, dtype=np.int64), gen_slots)) if slots else gen_slots
        self.table_shape = (len(slots), width)
        self.block_table.np[:len(slots) * width].reshape(len(slots), width)[:] = table[slots, :width]

    def _fill_verify(self, batch: ScheduledBatch, table: np.ndarray, off: int,
                     slots: list[int]) -> tuple[np.ndarray, int]:
        """Speculative decoding: each verifying request's last sampled token and its drafts, packed as a
        chunk after the context chunks; returns their sampled rows, K + 1 a request (past its drafts the
        last row again: the accept step never reads those), and the most blocks a chunk's row of the
        block table spans. One numpy pass over all of them."""
        steps, tok, tpb = batch.verify, self.tokens.np, self.tokens_per_block
        n = len(steps)
        lens = np.fromiter((v.length for v in steps), np.int64, n)  # [R]
        pos0 = np.fromiter((v.position for v in steps), np.int64, n)  # [R]
        row_slots = np.fromiter((v.request.slot for v in steps), np.int64, n)  # [R]
        starts = off + np.cumsum(lens) - lens  # [R] each chunk's first packed token
        total = batch.num_verify_tokens
        within = np.arange(total) - np.repeat(starts - off, lens)  # [N] offset inside its chunk
        pos = np.repeat(pos0, lens) + within  # [N]
        span = slice(off, off + total)
        tok[span, ID] = -1  # a chunk's first: the request's last token, written on the device (Engine)
        tok[span, ID][within > 0] = np.concatenate([v.drafts for v in steps])
        tok[span, POSITION] = pos
        chunk_slots = np.repeat(row_slots, lens)  # [N]
        tok[span, SLOT] = chunk_slots
        tok[span, PAGE] = table[chunk_slots, pos // tpb] * tpb + pos % tpb
        self.ctx_starts.extend(starts.tolist())
        self.ctx_lens.extend(lens.tolist())
        self.ctx_pos0.extend(pos0.tolist())
        slots.extend(row_slots.tolist())
        k1 = self.max_drafts + 1
        rows = (starts[:, None] + np.minimum(np.arange(k1), lens[:, None] - 1)).ravel()  # [R * (K + 1)]
        return rows, int(-(-(pos0 + lens).max() // tpb))

    def upload(self) -> None:
        """Issued on the device stream: the prefixes this step's fill wrote."""
        self.tokens.upload(self.num_tokens)
        self.rows.upload(self.num_samples)
        self.block_table.upload(self.table_shape[0] * self.table_shape[1])

    def download(self) -> None:
        """Nothing comes back: the logits stay on the device, for the sampler."""

    def device_block_table(self) -> torch.Tensor:
        r, w = self.table_shape
        return self.block_table.dev[:r * w].view(r, w)  # [R, W]
