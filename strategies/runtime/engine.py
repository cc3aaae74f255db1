"""The engine: one forward + sample over a scheduled batch, enqueued on the device stream.

It owns what lives on the device — model weights, KV pools, decoder state — and a small number of
buffer sets (runtime buffers + decoder step I/O), each a host staging half and a device half. The host
prepares a set, launches it, and later reads its outputs; every transfer between the halves is issued
on the stream inside the step, so it runs in order with the step's kernels. The engine never decides
*when* — that is the strategy's whole job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet, build_buffer_sets
from strategies.runtime.buffers.family import MAX_STOP_IDS, EngineSizes, StepFill
from strategies.runtime.buffers.mirrored import Mirrored
from strategies.runtime.device.stream import DeviceStream, DeviceWork
from strategies.runtime.kv_transfer.staging import KVStaging
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request

if TYPE_CHECKING:
    import torch

    from strategies.runtime.decoder.state import DecoderState
    from strategies.runtime.kv.host_pool import KVHostPool
    from strategies.runtime.kv.pool import KVCachePool



class Engine:
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, stream: DeviceStream, *, num_slots: int,
                 max_seq_len: int, max_tokens: int, max_batch: int, num_buffer_sets: int, num_blocks: int,
                 tokens_per_block: int, max_beam: int = 1, max_drafts: int = 0, kv_staging_blocks: int = 0,
                 kv_offload_blocks: int = 0) -> None:
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        memory = stream.memory
        self.cfg = cfg
        self.model = memory.place(model)
        self.stream = stream
        self.tokens_per_block = tokens_per_block
        self.kv = self._kv_storage(num_blocks, tokens_per_block)
        empty = memory.zeros((0,), cfg.dtype)
        self._k, self._v = (self.kv.k, self.kv.v) if self.kv is not None else (empty, empty)
        self.state = self._decoder_state(num_slots, max_beam, max_seq_len)
        # Finished beam requests' hypotheses, read back once per finish (not per step): [F, Kb, L] tokens,
        # [F, Kb] lengths and scores, for the slots listed in ``_final_slots``.
        kb, g = (max_beam, max_seq_len) if max_beam > 1 else (0, 0)
        self._final_slots = Mirrored(memory, (num_slots,), "int64")
        self._final_tokens = Mirrored(memory, (num_slots, kb, g), "int64")
        self._final_lens = Mirrored(memory, (num_slots, kb), "int64")
        self._final_scores = Mirrored(memory, (num_slots, kb), "float32")
        # Every registered buffer family, in each set (buffers/buffer_set.py: FAMILIES)
        self.buffer_sets = build_buffer_sets(cfg, EngineSizes(num_slots, max_seq_len, max_tokens, max_batch,
                                                              num_buffer_sets, num_blocks, tokens_per_block, max_beam,
                                                              max_drafts, kv_staging_blocks, kv_offload_blocks), memory)
        # Disaggregated serving: the bounded buffer this engine's KV blocks leave or arrive through
        self.kv_staging = (KVStaging(cfg, kv_staging_blocks, tokens_per_block, memory) if kv_staging_blocks
                           else None)
        # The host KV tier's storage (the simulated device stores no KV: its copies are only priced)
        self.host_pool = (self._host_pool(kv_offload_blocks, tokens_per_block)
                          if kv_offload_blocks and self.kv is not None else None)
        self.fault_at_iteration: int | None = None  # test hook: the device step raises at this iteration

    def _kv_storage(self, num_blocks: int, tokens_per_block: int) -> KVCachePool | None:
        from strategies.runtime.kv.pool import KVCachePool  # torch: the simulated engine stores no KV

        return KVCachePool(self.cfg, num_blocks, tokens_per_block, self.stream.memory)

    def _host_pool(self, num_blocks: int, tokens_per_block: int) -> KVHostPool:
        from strategies.runtime.kv.host_pool import KVHostPool

        return KVHostPool(self.cfg, num_blocks, tokens_per_block, self.stream.memory)

    def _decoder_state(self, num_slots: int, max_beam: int, max_seq_len: int) -> DecoderState:
        from strategies.runtime.decoder.state import DecoderState  # torch: the simulated engine has its own

        return DecoderState(num_slots, MAX_STOP_IDS, self.stream.memory, max_beam, max_seq_len)

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block of the model, every layer and KV head: what a host-tier copy moves."""
        return self.cfg.kv_bytes_per_token * self.tokens_per_block

    def prepare(self, batch: ScheduledBatch, bufs: BufferSet, block_table: np.ndarray,
                cross_table: np.ndarray | None = None) -> None:
        """Host side: write the batch into the set's staging buffers (``block_table [S, Kb, MB]``: per
        slot and beam; ``cross_table [S, MB]``: encoder–decoder models' cross-attention blocks)."""
        bufs.fill_step(StepFill(batch, batch.sampled_requests, block_table, cross_table, self.cfg.eos_token_id))

    def launch(self, iteration: int, bufs: BufferSet) -> DeviceWork:
        """Enqueue forward and sample for ``bufs`` (after the host KV tier's copies, where it has any); returns
        at once."""
        return self.stream.enqueue(iteration, [*self.copy_pieces(bufs), ("forward", self._forward, (iteration, bufs)),
                                               ("sample", self._sample, (bufs,))])

    def copy_pieces(self, bufs: BufferSet) -> list:
        """The host KV tier's piece for ``bufs``' step, ahead of its forward: [] when it moves no block."""
        c = bufs.kv_copies
        return [("kv_host_copy", self._kv_host_copy, (bufs,))] if c is not None and c.any else []

    def _kv_host_copy(self, bufs: BufferSet) -> None:
        assert bufs.kv_copies is not None
        if self.host_pool is not None:
            self.host_pool.copy(bufs.kv_copies, self._k, self._v)

    def outputs(self, bufs: BufferSet) -> np.ndarray:
        """[R, 2] token, finish code per request; valid once the step's work is waited for (and until the set
        is prepared again). The host buffer's numpy view: no torch call on the host's per-iteration path
        (tests/test_host_path.py)."""
        return bufs.step.out.np[:len(bufs.step.rows)]

    def verify_outputs(self, bufs: BufferSet) -> list[list[int]]:
        """Speculative decoding, per verifying request: K + 1 target tokens, tokens received, finish code,
        drafts received (``DraftTokens.out``); valid once the step's work is waited for."""
        d = bufs.drafts
        return d.out.np[:d.num_rows].tolist() if d is not None else []

    def read_beams(self, iteration: int, requests: list[Request]) -> list[list[tuple[list[int], float]]]:
        """The finished hypotheses of beam requests the device has finished, best first, each as (tokens,
        score): one gather and download on the stream, waited for. Called before their slots are released,
        so no later admission can overwrite them first."""
        n = len(requests)
        for i, r in enumerate(requests):
            self._final_slots.np[i] = r.slot
        self.stream.wait(self.stream.enqueue(iteration, [("finalize", self._gather_finals, (n,))]))
        out = []
        for i, r in enumerate(requests):
            lens, scores = self._final_lens.np[i], self._final_scores.np[i]
            out.append([(self._final_tokens.np[i, j, :lens[j]].tolist(), float(scores[j]))
                        for j in range(r.sampling.num_return_sequences)])
        return out

    def _gather_finals(self, n: int) -> None:
        """Device side of ``read_beams``: the hypotheses of the ``n`` slots in ``_final_slots``, downloaded."""
        self._final_slots.upload(n)
        slots = self._final_slots.dev[:n]
        self._final_tokens.dev[:n] = self.state.hyp_seq[slots]
        self._final_lens.dev[:n] = self.state.hyp_len[slots]
        self._final_scores.dev[:n] = self.state.hyp_score[slots]
        for m in (self._final_tokens, self._final_lens, self._final_scores):
            m.download(n)

    def kv_send(self, n: int, peer: int | None = None) -> None:
        """Device piece: the ``n`` blocks listed in the staging buffer out of the pool, to rank ``peer`` of the
        KV link (device processes) or to the buffer's host half (``peer`` None: the host relays them)."""
        assert self.kv_staging is not None
        self.kv_staging.send(n, self._k, self._v, peer)

    def kv_recv(self, n: int, peer: int | None = None, source: torch.Tensor | None = None) -> None:
        """Device piece: ``n`` blocks from rank ``peer`` of the KV link (or from the sender's host half
        ``source``) into the blocks the staging buffer lists."""
        assert self.kv_staging is not None
        self.kv_staging.receive(n, self._k, self._v, peer, source)

    def _check_fault(self, iteration: int) -> None:
        if self.fault_at_iteration is not None and iteration >= self.fault_at_iteration:
            raise RuntimeError(f"injected engine fault at iteration {iteration}")

    def _forward(self, iteration: int, bufs: BufferSet) -> None:
        self._check_fault(iteration)
        rb, io, d = bufs.runtime, bufs.step, bufs.drafts
        bufs.upload()
        if io.num_admit:
            a = io.admit.dev[:io.num_admit]
            self.state.admit(a[:, 0], a[:, 1:], io.admit_f.dev[:io.num_admit])
        if d is not None and d.num_rows:  # a verifying chunk starts with the request's last token, read on the
            # device as a generation row's is (under overlap the host has not seen it): each chunk's first
            # token is its first sampled row, K + 1 rows a request, after every other row
            k1, n = d.k + 1, d.num_rows
            starts = rb.rows.dev[rb.num_samples - n * k1:rb.num_samples:k1]  # [R]
            rb.tokens.dev[starts, 0] = self.state.last_token[d.slots.dev[:n], 0]
        self._step_model(bufs)

    def _step_model(self, bufs: BufferSet) -> None:
        rb = bufs.runtime
        # Generation inputs come from the decoder state on the device, never from the host.
        self.model.step(rb.tokens.dev[:rb.num_tokens], rb.device_block_table(), rb.ctx_starts, rb.ctx_lens,
                        rb.ctx_pos0, rb.num_ctx_tokens, rb.gen_kmax, self.tokens_per_block,
                        rb.rows.dev[:rb.num_samples], self.state.last_token_rows, self._k, self._v, rb.logits,
                        self.state.indirection, self.state.max_beam)

    def _sample(self, bufs: BufferSet) -> None:
        rb, io = bufs.runtime, bufs.step
        if rb.num_samples == 0:
            return
        n = io.num_single
        if n:
            self.state.sample(rb.logits[:n], io.slots.dev[:n], io.out.dev[:n], io.use_filters, io.any_random)
        row = n
        for width, count, pool, glen, kv_width in io.groups:  # beam requests, one call per width
            self.state.beam_step(rb.logits[row:row + count * width], io.slots.dev[n:n + count],
                                 io.out.dev[n:n + count], width, pool, glen, kv_width)
            row, n = row + count * width, n + count
        d = bufs.drafts
        if d is not None and d.num_rows:  # verifying rows follow every other row, K + 1 each
            k1 = d.k + 1
            self.state.accept(rb.logits[row:row + d.num_rows * k1], d.slots.dev[:d.num_rows], d.drafts.dev[:d.num_rows],
                              d.num_drafts.dev[:d.num_rows], d.out.dev[:d.num_rows], d.use_filters, d.any_random)
        bufs.download()
