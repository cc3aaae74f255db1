"""What the host sends each stage for one micro-batch, laid out for point-to-point send/recv.

Three tensors, each a preallocated buffer whose prefix is sent: a fixed ``header [20]`` (sizes, flags,
the test hooks), then ``ints`` (the runtime buffers, decoder step inputs and the host KV tier's copy lists,
concatenated) and ``floats``
(the admitted rows' sampling parameters; the last stage only). A stage receives into buffers of the
same maximum sizes and reads views of them, so nothing is allocated per step on either side.
"""

from __future__ import annotations

import torch

from strategies.runtime.buffers.kv_copies import KVCopies
from strategies.runtime.buffers.runtime_buffers import RuntimeBuffers
from strategies.runtime.buffers.step_io import ADMIT_INTS, StepIO

# header fields
(KIND, ITERATION, SET, TOKENS, SAMPLES, CTX_TOKENS, GEN_KMAX, TABLE_ROWS, TABLE_WIDTH, CHUNKS, OUTPUTS, ADMITS,
 FILTERS, RANDOM, FAULT_STAGE, FAULT_KIND, INTS, FLOATS, OFFLOADS, ONLOADS) = range(20)
HEADER = 20  # a receive must match its send's size: the header says how long ``ints`` and ``floats`` are
STEP, STOP = 0, 1  # KIND
DIE, HANG = 1, 2  # FAULT_KIND: a test hook's stage exits, or stops answering


def max_ints(max_tokens: int, max_batch: int, max_blocks: int, max_stop_ids: int, max_copies: int = 0) -> int:
    return max_tokens * 4 + max_batch + max_batch * max_blocks + 3 * max_tokens + max_batch \
        + max_batch * (ADMIT_INTS + max_stop_ids) + 4 * max_copies


def pack(iteration: int, index: int, rb: RuntimeBuffers, io: StepIO, header: torch.Tensor, ints: torch.Tensor,
         floats: torch.Tensor, fault: tuple[int, int], copies: KVCopies | None = None) -> tuple[int, int]:
    """Write one micro-batch into the send buffers; returns the lengths of ``ints`` and ``floats`` used."""
    r, w = rb.table_shape
    n_ctx, n_out, n_admit = len(rb.ctx_starts), len(io.rows), io.num_admit
    n_off, n_on = (copies.num_offload, copies.num_onload) if copies is not None else (0, 0)
    parts = (rb.tokens.np[:rb.num_tokens].reshape(-1), rb.rows.np[:rb.num_samples], rb.block_table.np[:r * w],
             rb.ctx_starts, rb.ctx_lens, rb.ctx_pos0, io.slots.np[:n_out], io.admit.np[:n_admit].reshape(-1))
    if copies is not None:
        parts += (copies.offload.np[:n_off].reshape(-1), copies.onload.np[:n_on].reshape(-1))
    out = ints.numpy()
    off = 0
    for p in parts:
        out[off:off + len(p)] = p
        off += len(p)
    nf = n_admit * io.admit_f.host.shape[1]
    floats[:nf] = io.admit_f.host[:n_admit].reshape(-1)
    header.numpy()[:] = (STEP, iteration, index, rb.num_tokens, rb.num_samples, rb.num_ctx_tokens, rb.gen_kmax,
                         r, w, n_ctx, n_out, n_admit, int(io.use_filters), int(io.any_random), *fault, off, nf,
                         n_off, n_on)
    return off, nf


class Unpacked:
    """Views of a received micro-batch (valid until the buffers are received into again)."""

    def __init__(self, header: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, admit_width: int) -> None:
        h = header.tolist()
        self.iteration, self.num_tokens, self.num_samples = h[ITERATION], h[TOKENS], h[SAMPLES]
        self.num_ctx_tokens, self.gen_kmax = h[CTX_TOKENS], h[GEN_KMAX]
        self.use_filters, self.any_random = bool(h[FILTERS]), bool(h[RANDOM])
        self.fault = (h[FAULT_STAGE], h[FAULT_KIND])
        t, b, (r, w), n_ctx, n_out, n_admit = h[TOKENS], h[SAMPLES], (h[TABLE_ROWS], h[TABLE_WIDTH]), h[CHUNKS], \
            h[OUTPUTS], h[ADMITS]
        off = 0

        def take(n: int) -> torch.Tensor:
            nonlocal off
            off += n
            return ints[off - n:off]

        self.tokens = take(t * 4).view(t, 4)  # [T, 4]
        self.rows = take(b)  # [B]
        self.block_table = take(r * w).view(r, w)  # [R, W]
        ctx = take(3 * n_ctx).tolist()
        self.ctx_starts, self.ctx_lens, self.ctx_pos0 = ctx[:n_ctx], ctx[n_ctx:2 * n_ctx], ctx[2 * n_ctx:]
        self.slots = take(n_out)  # [R_out]
        self.admit = take(n_admit * admit_width).view(n_admit, admit_width)  # [A, 7 + M]
        self.admit_f = floats[:n_admit * 4].view(n_admit, 4)  # [A, 4]
        self.offload = take(2 * h[OFFLOADS]).view(-1, 2)  # [n, 2] (GPU block, host block)
        self.onload = take(2 * h[ONLOADS]).view(-1, 2)  # [m, 2] (host block, GPU block)
        self.num_outputs = n_out
