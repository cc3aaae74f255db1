"""The recorder: fills a step's ``IterationRecord`` at the boundaries of its phases, so that no strategy's loop
writes a record field itself.

A strategy's parts call it as each phase ends — ``scheduled`` (what the schedule chose and what the caches
held then), ``launched`` (what was handed to the device), ``waited`` (the device's own times) — and it keeps
the one thing the records need across steps: whether the host waited for a step before it launched the next.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strategies.runtime.batch import ScheduledBatch
    from strategies.runtime.buffers.buffer_set import BufferSet
    from strategies.runtime.buffers.slots import SlotManager
    from strategies.runtime.device.clock import Clock
    from strategies.runtime.device.stream import DeviceWork
    from strategies.runtime.iteration import IterationRecord
    from strategies.runtime.kv.block_manager import BlockManager


class StepRecorder:
    def __init__(self, clock: Clock, slots: SlotManager, kv: BlockManager, waiting: Sized,
                 records: list[IterationRecord], worker: str = "", block_bytes: int = 0) -> None:
        self.clock = clock
        self.slots = slots
        self.kv = kv
        self.waiting = waiting  # the strategy's queue (its length is recorded)
        self.records = records  # the strategy's: one record per step that ran work, in schedule order
        self.worker = worker  # the records' ``worker`` column: a fleet's worker (prefill0, ...), else empty
        self.block_bytes = block_bytes  # a KV block's bytes (the host tier's copies are counted in them too)
        self._evictions_seen = 0
        self._last_launched: IterationRecord | None = None
        self._last_waited: IterationRecord | None = None

    def scheduled(self, rec: IterationRecord, batch: ScheduledBatch) -> None:
        """The schedule phase ended with ``batch``: its counts and the caches' state after it."""
        rec.worker = self.worker
        rec.count_batch(batch)
        rec.active_slots = self.slots.num_used
        rec.waiting_requests = len(self.waiting)
        kv = self.kv
        rec.kv_blocks_used = kv.blocks_in_use
        rec.kv_blocks_total = kv.total_blocks
        rec.kv_blocks_cached = kv.cached_free_blocks
        rec.kv_evictions, self._evictions_seen = kv.evictions - self._evictions_seen, kv.evictions
        rec.preemptions = len(batch.preempted)
        if kv.host is not None:
            rec.host_kv_blocks_used, rec.host_kv_blocks_total = kv.host.used_blocks, kv.host.num_blocks
            rec.kv_offloaded_blocks, rec.kv_onloaded_blocks = len(batch.kv_offload), len(batch.kv_onload)
            rec.kv_offloaded_bytes = rec.kv_offloaded_blocks * self.block_bytes
            rec.kv_onloaded_bytes = rec.kv_onloaded_blocks * self.block_bytes
        if batch:
            self.records.append(rec)

    def launched(self, rec: IterationRecord, bufs: BufferSet) -> None:
        """The step was enqueued from ``bufs``."""
        rec.launch_s = self.clock.now()
        rec.buffer_set = bufs.index
        rec.num_samples = bufs.runtime.num_samples
        rec.num_encoder_tokens = bufs.encoder.num_tokens if bufs.encoder is not None else 0
        rec.count_work(bufs.work)
        if self._last_launched is not None:
            self._last_launched.waited_before_next_launch = int(self._last_waited is self._last_launched)
        self._last_launched = rec

    def waited(self, rec: IterationRecord, work: DeviceWork, wait_s: float) -> None:
        """The host waited ``wait_s`` for the step's device work, whose pieces' times are now known."""
        rec.wait_s = wait_s
        self._last_waited = rec
        for name, (start, end) in work.times.items():
            setattr(rec, f"{name}_start_s", start)
            setattr(rec, f"{name}_end_s", end)
        if work.stages:
            rec.stage_start_s = tuple(s for s, _ in work.stages)
            rec.stage_end_s = tuple(e for _, e in work.stages)
