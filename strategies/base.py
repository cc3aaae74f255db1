"""The strategy interface and the three parts every strategy is made of.

schedule (host) → forward + sample (device) → postprocess (host). A strategy only decides how these are
arranged in its loop and what its schedule admits; the runtime underneath is the same for all, so a
difference between strategies in a report comes from scheduling alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar, Protocol

import torch

from strategies.config import ExecutorConfig
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.block_manager import BlockManager, beam_blocks
from strategies.runtime.clock import Clock
from strategies.runtime.decoder_state import CONTINUE, DISCARDED, FINISH_REASONS
from strategies.runtime.device import DeviceWork, make_stream
from strategies.runtime.engine import MAX_STOP_IDS, BufferSet, Engine
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.model_config import ModelConfig
from strategies.runtime.request import Request, Status
from strategies.runtime.slots import SlotManager
from strategies.runtime.tracing import Nvtx


class RequestSource(Protocol):
    """Where requests come from (the harness's trace replay): arrivals, and who to tell of an end."""

    def poll(self, now_s: float) -> list[Request]:
        """Requests that have arrived by ``now_s`` and may be sent, each once."""

    def next_arrival_s(self) -> float | None:
        """When the next request can arrive; None if none will until a request ends (or ever)."""

    @property
    def exhausted(self) -> bool:
        """True once every request has been handed out."""

    def on_finished(self, request: Request) -> None:
        """A request reached a terminal status (finished or rejected)."""


class ExecutorStalled(RuntimeError):
    pass


class Executor(ABC):
    """What the harness drives: serve a request source, keep iteration records, close."""

    name: ClassVar[str]

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 clock: Clock | None = None) -> None:
        self.model_cfg = model_cfg
        self.model = model
        self.config = config
        self.clock = clock or make_clock(config)
        self.records: list[IterationRecord] = []
        self.source: RequestSource | None = None
        self.iteration_hook: Callable[[int], None] | None = None  # called as each iteration starts

    @abstractmethod
    def run(self, source: RequestSource) -> None:
        """Serve every request ``source`` hands out until none is left. Raises on an engine fault; the
        requests then keep the state they reached, for the caller to mark failed."""

    def close(self) -> None:
        """Release threads and devices; safe to call after a failure."""

    def inject_fault(self, iteration: int) -> None:
        """Test hook: make the device step raise at ``iteration``."""
        raise NotImplementedError(f"{self.name} has no fault hook")

    def rejection(self, r: Request) -> str | None:
        """Why ``r`` can never be served by this executor, or None."""
        c, cfg = self.config, self.model_cfg
        if r.prompt_len == 0:
            return "empty prompt"
        if r.max_new_tokens <= 0:
            return f"max_new_tokens must be positive, got {r.max_new_tokens}"
        if r.prompt_len + r.max_new_tokens > c.max_seq_len:
            return (f"prompt ({r.prompt_len}) + max_new_tokens ({r.max_new_tokens}) exceeds "
                    f"max_seq_len ({c.max_seq_len})")
        if r.width > c.max_beam_width:
            return f"beam width {r.width} exceeds the executor's maximum ({c.max_beam_width})"
        if beam_blocks(r.prompt_len + r.max_new_tokens, c.tokens_per_block, r.width, r.prompt_len) > c.total_kv_blocks:
            return f"needs more KV blocks than the cache has ({c.total_kv_blocks})"
        if len(r.sampling.stop_token_ids) >= MAX_STOP_IDS:
            return f"at most {MAX_STOP_IDS - 1} stop token ids"
        if r.prompt_token_ids.min() < 0 or r.prompt_token_ids.max() >= cfg.vocab_size:
            return f"prompt token id outside the vocabulary [0, {cfg.vocab_size})"
        return self._encoder_rejection(r)

    def _encoder_rejection(self, r: Request) -> str | None:
        c, cfg = self.config, self.model_cfg
        if not cfg.is_encoder_decoder:
            return "encoder input given to a decoder-only model" if r.encoder_len else None
        if r.encoder_len == 0:
            return "an encoder–decoder model needs encoder input"
        if r.width > 1:
            return "beam search with an encoder–decoder model is not supported"
        if r.encoder_len > c.max_seq_len or r.encoder_len >= c.max_num_tokens:
            return (f"encoder input ({r.encoder_len}) must fit max_seq_len ({c.max_seq_len}) and leave room in "
                    f"max_num_tokens ({c.max_num_tokens}): it is encoded whole, in the step that admits it")
        if -(-r.encoder_len // c.tokens_per_block) > c.total_cross_kv_blocks:
            return f"needs more cross-attention KV blocks than the cache has ({c.total_cross_kv_blocks})"
        ids = r.encoder_prompt_token_ids
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            return f"encoder token id outside the vocabulary [0, {cfg.vocab_size})"
        return None

    def _reject(self, r: Request, reason: str) -> None:
        r.end(Status.REJECTED, reason)
        assert self.source is not None
        self.source.on_finished(r)


class Strategy(Executor):
    """A slotbench executor: the shared runtime, arranged by a loop of schedule → launch → postprocess."""

    num_buffer_sets: ClassVar[int] = 1
    separate_processes: ClassVar[bool] = False  # the device is other processes (pipeline stages)
    pipeline_stages: ClassVar[int] = 1  # stages the device is split into (the pipeline strategy's --pp)

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 clock: Clock | None = None) -> None:
        super().__init__(model_cfg, model, config, clock)
        self.nvtx = Nvtx(config.instrument)
        c = config
        sizes = {"num_slots": c.max_batch_size, "max_seq_len": c.max_seq_len, "max_tokens": self.max_tokens_per_step(),
                 "max_batch": c.max_batch_size, "num_buffer_sets": self.num_buffer_sets,
                 "num_blocks": c.total_kv_blocks, "tokens_per_block": c.tokens_per_block, "max_beam": c.max_beam_width}
        if c.device == "sim":
            from strategies.runtime.sim.build import sim_engine

            assert c.sim is not None
            self.stream, self.engine = sim_engine(model_cfg, c.sim, self.clock, self.nvtx, sizes, self.pipeline_stages)
        elif self.separate_processes:
            self.stream, self.engine = self._process_engine(sizes)
        else:
            self.stream = make_stream(c.device, self.clock, self.nvtx, c.device_threads, c.memory)
            if model_cfg.is_encoder_decoder:
                from strategies.runtime.encdec_engine import EncoderDecoderEngine

                self.engine = EncoderDecoderEngine(model_cfg, model, self.stream, cross_blocks=c.total_cross_kv_blocks,
                                                   **sizes)
            else:
                self.engine = Engine(model_cfg, model, self.stream, **sizes)
        self.slots = SlotManager(c.max_batch_size)
        self.kv = BlockManager(c.total_kv_blocks, c.tokens_per_block, c.max_batch_size, c.max_blocks_per_seq,
                               c.prefix_caching, c.max_beam_width)
        # Encoder–decoder models: the cross-attention KV's blocks, held from admission to the end
        self.cross_kv = BlockManager(c.total_cross_kv_blocks, c.tokens_per_block, c.max_batch_size,
                                     c.max_blocks_per_seq) if model_cfg.is_encoder_decoder else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._admissions = 0
        self._evictions_seen = 0
        self._last_launched: IterationRecord | None = None
        self._last_waited: IterationRecord | None = None

    # --- interface --------------------------------------------------------------------------------
    def run(self, source: RequestSource) -> None:
        self.source = source
        self._loop()

    def close(self) -> None:
        """Stop the device stream and drop the device's tensors (weights, KV pools, buffers), so that
        nothing of this executor stays on the card while the next one runs."""
        self.stream.close()
        self.engine = None  # type: ignore[assignment]

    def inject_fault(self, iteration: int) -> None:
        self.engine.fault_at_iteration = iteration

    def _process_engine(self, sizes: dict) -> tuple:
        """(stream, engine) of a device made of other processes (pipeline stages)."""
        raise NotImplementedError

    def max_tokens_per_step(self) -> int:
        return self.config.max_num_tokens

    def _loop(self) -> None:
        """The synchronous loop: schedule → launch → wait → postprocess, one step at a time."""
        bufs = self.engine.buffer_sets[0]
        iteration = 0
        while self._intake():
            self.nvtx.push("iteration")
            rec, batch = self._schedule_phase(iteration)
            if batch:
                work = self._launch(rec, batch, bufs)
                self._wait(rec, work)
                self._postprocess(rec, bufs)
                self._after_step()
                iteration += 1
            self.nvtx.pop()
            if not batch:
                self._idle()

    def _after_step(self) -> None:
        """Hook after each step's postprocess (static ends its batch here)."""

    @abstractmethod
    def schedule(self, iteration: int) -> ScheduledBatch: ...

    # --- intake and idling ------------------------------------------------------------------------
    def _intake(self) -> bool:
        """Move arrived requests into the queue; False once there is nothing left to do."""
        assert self.source is not None
        for r in self.source.poll(self.clock.now()):
            reason = self.rejection(r)
            if reason is None:
                self.waiting.append(r)
            else:
                self._reject(r, reason)
        return bool(self.waiting or self.running or not self.source.exhausted)

    def _idle(self) -> None:
        assert self.source is not None
        nxt = self.source.next_arrival_s()
        if nxt is None:
            raise ExecutorStalled(f"{self.name}: nothing schedulable and nothing arriving "
                                  f"({len(self.waiting)} waiting, {len(self.running)} running)")
        self.clock.sleep_until(nxt)

    # --- slots and KV ---------------------------------------------------------------------------
    def _admit(self, r: Request, hits: list[int], reserve_tokens: int) -> None:
        """Give ``r`` a slot, its cached prefix blocks ``hits``, and blocks up to ``reserve_tokens``."""
        slot = self.slots.acquire(r.request_id)
        r.admit(slot, self._admissions, len(hits) * self.kv.tokens_per_block)
        self._admissions += 1
        self.kv.admit(slot, hits, reserve_tokens, r.width, r.prompt_len)
        if self.cross_kv is not None:
            self.cross_kv.admit(slot, [], r.encoder_len)
        self.running.append(r)

    def _release(self, r: Request) -> None:
        if r.slot is not None:
            self.kv.release(r.slot, r)
            if self.cross_kv is not None:
                self.cross_kv.release(r.slot, r)
            self.slots.release(r.slot, r.request_id)
            r.slot = None
        if r in self.running:
            self.running.remove(r)

    # --- the three parts ------------------------------------------------------------------------
    @contextmanager
    def _phase(self, rec: IterationRecord, name: str) -> Iterator[None]:
        self.nvtx.push(name)
        start = self.clock.now()
        try:
            yield
        finally:
            self.clock.charge_host(name, len(self.running))
            setattr(rec, f"{name}_start_s", start)
            setattr(rec, f"{name}_end_s", self.clock.now())
            self.nvtx.pop()

    def _schedule_phase(self, iteration: int) -> tuple[IterationRecord, ScheduledBatch]:
        if self.iteration_hook is not None:
            self.iteration_hook(iteration)
        rec = IterationRecord(iteration)
        with self._phase(rec, "schedule"):
            batch = self.schedule(iteration)
            if self.kv.prefix_caching:  # blocks this step fills become reusable for later steps
                for r in self.running:
                    self.kv.commit(r.slot, r)
        rec.num_context_requests = len(batch.context)
        rec.num_generation_requests = batch.num_generation_rows
        rec.num_beam_rows = batch.num_beam_rows
        rec.num_tokens = batch.num_tokens
        rec.num_padding_tokens = batch.num_padding_tokens
        rec.active_slots = self.slots.num_used
        rec.waiting_requests = len(self.waiting)
        rec.kv_blocks_used = self.kv.blocks_in_use
        rec.kv_blocks_total = self.kv.total_blocks
        rec.kv_blocks_cached = self.kv.cached_free_blocks
        rec.kv_evictions, self._evictions_seen = self.kv.evictions - self._evictions_seen, self.kv.evictions
        rec.preemptions = len(batch.preempted)
        if batch:
            self.records.append(rec)
        return rec, batch

    def _launch(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> DeviceWork:
        with self._phase(rec, "prepare"):
            self.engine.prepare(batch, bufs, self.kv.tables, self.cross_kv.table if self.cross_kv else None)
        work = self.engine.launch(rec.iteration, bufs)
        rec.launch_s = self.clock.now()
        rec.num_samples = bufs.runtime.num_samples
        rec.num_encoder_tokens = bufs.encoder.num_tokens if bufs.encoder is not None else 0
        w = bufs.work
        rec.kv_read_tokens, rec.attention_pairs = w.kv_read_tokens, w.attention_pairs
        rec.num_context_tokens = w.context_tokens
        rec.context_kv_read_tokens, rec.context_attention_pairs = w.context_kv_read_tokens, w.context_attention_pairs
        if self._last_launched is not None:
            self._last_launched.waited_before_next_launch = int(self._last_waited is self._last_launched)
        self._last_launched = rec
        return work

    def _wait(self, rec: IterationRecord, work: DeviceWork) -> None:
        rec.wait_s = self.stream.wait(work)
        self._last_waited = rec
        for name, (start, end) in work.times.items():
            setattr(rec, f"{name}_start_s", start)
            setattr(rec, f"{name}_end_s", end)
        if work.stages:
            rec.stage_start_s = tuple(s for s, _ in work.stages)
            rec.stage_end_s = tuple(e for _, e in work.stages)

    def _postprocess(self, rec: IterationRecord, bufs: BufferSet) -> None:
        """Hand each sampled token to its request; finish the ones the device says are done. Rows the
        device computed for a request it knew to be finished (static's done rows, overlap's one extra
        step) are padding. A finished beam request's sequences are read back before its slot is let go."""
        with self._phase(rec, "postprocess"):
            tokens, codes = self.engine.outputs(bufs)
            now = self.clock.now()  # the host holds the tokens from here: what a streaming client sees
            beams_done: list[tuple[Request, int]] = []
            for r, tok, code in zip(bufs.step.rows, tokens, codes, strict=True):
                r.pending_samples -= 1
                if code == DISCARDED:
                    rec.num_padding_tokens += r.width
                    continue
                if r.status.terminal:
                    continue
                if r.width > 1 and r.status is Status.WAITING:  # preempted: the beam search starts over
                    rec.num_padding_tokens += r.width
                    continue
                r.append_token(tok, now)
                if code != CONTINUE:
                    if r.width > 1:
                        beams_done.append((r, code))
                    else:
                        self._finish(r, FINISH_REASONS[code])
            if beams_done:
                results = self.engine.read_beams(rec.iteration, [r for r, _ in beams_done])
                for (r, code), beams in zip(beams_done, results, strict=True):
                    r.beams = beams
                    self._finish(r, FINISH_REASONS[code])

    def _finish(self, r: Request, reason: str) -> None:
        self._release(r)
        if r in self.waiting:  # overlap: preempted while its last token was still on the device
            self.waiting.remove(r)
        r.end(Status.FINISHED, reason)
        assert self.source is not None
        self.source.on_finished(r)


def make_clock(config: ExecutorConfig) -> Clock:
    """The run clock: wall time, or the simulated device's virtual time."""
    if config.device == "sim":
        from strategies.runtime.sim.build import virtual_clock

        assert config.sim is not None
        return virtual_clock(config.sim)
    return Clock()
