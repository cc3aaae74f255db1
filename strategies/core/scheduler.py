"""A strategy's scheduler: it owns the requests and what they hold — the waiting queue, the running list, the
request slots, the progress book, the KV pools — and its policy decides each step.

Two boundaries, as vLLM's ``Scheduler`` has them: ``schedule`` (the policy's choice for the next step, with the
admissions, preemptions and prefix-cache commits it makes) and ``update_from_output`` (a step's sampled tokens
handed to their requests, the finished ones finished: ``core/postprocess.py``). Between them the requests'
state changes only through this object's calls — ``add``, ``admit``, ``adopt``, ``preempt``, ``release``,
``finish``, ``abort`` — so a policy, a fleet's role or a strategy's hook never edits the queues itself.
The policy (``strategies/scheduler.py``'s iteration-level one, ``static/batcher.py``) has one signature,
``schedule(iteration, queues, running)``: this object as ``queues`` (the queue, free slots, admit, preempt),
and the running requests it may give rows this step (a strategy's hook narrows them: a pipeline's requests in
flight, a prefill worker's finished prompts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from strategies.core.postprocess import hand_out
from strategies.running import RunningRequests
from strategies.runtime.buffers.slots import SlotManager
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.progress import COMPUTED, SlotProgress
from strategies.runtime.request import Request, Status

if TYPE_CHECKING:
    from strategies.config import ExecutorConfig
    from strategies.parts import Policy
    from strategies.runtime.batch import ScheduledBatch
    from strategies.runtime.buffers.buffer_set import BufferSet
    from strategies.runtime.device.clock import Clock
    from strategies.runtime.iteration import IterationRecord


class Scheduler:
    policy: Policy  # set by the strategy once the state exists (a policy reads the KV pool and the book)

    def __init__(self, config: ExecutorConfig, clock: Clock, encoder_decoder: bool = False,
                 holds_finished_rows: bool = False) -> None:
        c = config
        self.clock = clock
        self.holds_finished_rows = holds_finished_rows  # a finished request keeps its slot to its batch's end
        self.slots = SlotManager(c.max_batch_size)
        self.progress = SlotProgress(c.max_batch_size)  # running requests' counters and tokens, per slot
        self.kv = BlockManager(c.total_kv_blocks, c.tokens_per_block, c.max_batch_size, c.max_blocks_per_seq,
                               c.prefix_caching, c.max_beam_width, c.kv_offload_blocks)
        # Encoder–decoder models: the cross-attention KV's blocks, held from admission to the end
        self.cross_kv = BlockManager(c.total_cross_kv_blocks, c.tokens_per_block, c.max_batch_size,
                                     c.max_blocks_per_seq) if encoder_decoder else None
        self.waiting: deque[Request] = deque()
        self.running = RunningRequests(c.max_batch_size)  # admission order, each request's slot beside it
        self.on_finished: Callable[[Request], None] = _no_source  # the request source's (``Strategy.take_from``)
        self._admissions = 0
        self._scheduling = -1  # the iteration whose schedule runs now (admissions start their slot tenure there)
        self.last_scheduled = -1  # the last iteration scheduled with work: a release's last computed step

    # --- the queues a policy reads and changes -------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.slots.num_free

    def add(self, r: Request) -> None:
        """An arrival joins the queue."""
        self.waiting.append(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, r: Request, hits: list[int], reserve_tokens: int) -> None:
        """Give ``r`` a slot, its cached prefix blocks ``hits``, and blocks up to ``reserve_tokens``."""
        slot = self.slots.acquire(r.request_id, self._scheduling, r.width)
        tpb = self.kv.tokens_per_block
        if r.admitted_seq < 0 and hits and min(hits) < 0:  # the host tier's share of its first prefix hit
            r.host_cached_tokens = min(sum(1 for b in hits if b < 0) * tpb, r.prompt_len)
        self.adopt(r, slot, len(hits) * tpb, self.clock.now())
        self.kv.admit(slot, hits, reserve_tokens, r.width, r.prompt_len, r.block_hashes)
        if self.cross_kv is not None:
            self.cross_kv.admit(slot, [], r.encoder_len)

    def adopt(self, r: Request, slot: int, computed: int, now_s: float | None = None) -> None:
        """Run ``r`` from the next schedule in ``slot``, whose blocks hold (or will hold) its first ``computed``
        tokens' KV: a prefix hit, or a disaggregated decode worker's transfer into blocks taken before it."""
        r.admit(slot, self._admissions, computed, now_s, self.progress)
        self._admissions += 1
        self.running.append(r)

    def release(self, r: Request, end: str = "finished") -> None:
        """Give back ``r``'s slot and blocks; ``end`` (finished | preempted | ...) closes its slot tenure."""
        if r.slot is not None:
            self.kv.release(r.slot, r)
            if self.cross_kv is not None:
                self.cross_kv.release(r.slot, r)
            self.slots.release(r.slot, r.request_id, self.last_scheduled, end)
            r.leave_slot()
        self.running.discard(r)  # (static keeps finished requests' slots; a preempted one is not running)

    def hand_off(self, r: Request) -> None:
        """``r`` leaves the running list, never scheduled here again, its slot and blocks still held (a prefill
        worker's request, its KV on its way to a decode worker: ``release`` when it has left)."""
        self.running.remove(r)

    def drop_all(self) -> None:
        """The engine died: nothing is queued or running any more (the requests were failed by the caller)."""
        self.waiting.clear()
        self.running.clear()

    def preempt(self, r: Request) -> None:
        """Free ``r``'s slot and blocks, requeued at the front: it recomputes what it had (max-utilization)."""
        self.release(r, "preempted")
        r.preempt()
        self.waiting.appendleft(r)

    def finish(self, r: Request, reason: str) -> None:
        """``r`` is done (``reason``): its slot and blocks go back (static: at its batch's end)."""
        if not self.holds_finished_rows:
            self.release(r)
        if r.status is Status.WAITING and r in self.waiting:  # overlap: preempted with its last token on the device
            self.waiting.remove(r)
        r.end(Status.FINISHED, reason)
        self.on_finished(r)

    def abort(self, r: Request, reason: str) -> None:
        """End ``r`` now (its client went away): out of the queue, or its slot and blocks given back (static:
        its row stays in the batch as padding). Between steps."""
        if r.status.terminal:
            return
        if r in self.waiting:
            self.waiting.remove(r)
        elif not self.holds_finished_rows:
            self.release(r, "aborted")
        r.end(Status.FAILED, reason, self.clock.now())
        self.on_finished(r)

    # --- the two boundaries ----------------------------------------------------------------------------
    def schedule(self, iteration: int, running: RunningRequests) -> ScheduledBatch:
        """The policy's next step over ``running`` (the running requests it may give rows) and the queue; the
        blocks it fills become reusable (prefix caching); a prefill's last chunk starts its slot's decoding."""
        self._scheduling = iteration
        batch = self.policy.schedule(iteration, self, running)
        if self.kv.host is not None:  # the host tier's copies this schedule's allocations and admissions made
            batch.kv_offload, batch.kv_onload = self.kv.take_copies()
        if self.kv.prefix_caching:  # one array test picks the rows whose computed tokens filled a block
            slots, rows = self.running.slots, self.running
            for i in self.kv.uncommitted(slots, self.progress.counters[slots, COMPUTED]).tolist():
                self.kv.commit(rows[i].slot, rows[i])
        for c in batch.context:
            if c.samples:
                self.slots.prefilled(c.request.slot, iteration)
        if batch:
            self.last_scheduled = iteration
        return batch

    def update_from_output(self, rec: IterationRecord, bufs: BufferSet, engine: Any) -> None:
        """Step ``rec``'s sampled tokens (in ``bufs``, read through ``engine``) handed to their requests, the
        finished ones finished (``core/postprocess.py``)."""
        hand_out(self, engine, rec, bufs)


def _no_source(r: Request) -> None:
    raise RuntimeError(f"request {r.request_id} ended with no request source to tell: Strategy.take_from first")
