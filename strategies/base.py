"""A slotbench strategy: the shared runtime, the three parts of a step — schedule (host) → forward + sample
(device) → postprocess (host) — and the parts a strategy is given (``parts.py``): a scheduling ``policy``, a
``drafter`` (``drafting.py``), a fleet ``role`` (``fleet.py``, ``disagg/workers.py``), a ``recorder``. The loop
is the engine core's (``core/engine_core.py``), the same for all: a concrete strategy subclasses ``Strategy``
once and says its depth (steps in flight), its policy and its hooks. The runtime underneath is the same for all,
so a difference between strategies in a report comes from scheduling alone.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from typing import TYPE_CHECKING, ClassVar

from strategies.config import ExecutorConfig
from strategies.core.engine_core import EngineCore, Step
from strategies.core.local_engine import engine_sizes, local_engine
from strategies.core.postprocess import hand_out
from strategies.drafting import build_drafter
from strategies.interface import Executor, ExecutorStalled, RequestSource
from strategies.parts import Policy, Role
from strategies.phase import HostPhase
from strategies.recorder import StepRecorder
from strategies.running import RunningRequests
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.buffers.slots import SlotManager, SlotTenure
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceWork
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.progress import COMPUTED, SlotProgress
from strategies.runtime.request import Request, Status

if TYPE_CHECKING:
    import torch

    from strategies.runtime.spec.draft_model import DraftModel


class Strategy(Executor):
    """A slotbench executor: the shared runtime, arranged by a loop of schedule → launch → postprocess."""

    depth: ClassVar[int] = 1  # steps in flight (each in a buffer set of its own): the engine core's queue
    separate_processes: ClassVar[bool] = False  # the device is other processes (pipeline stages)
    pipeline_stages: ClassVar[int] = 1  # stages the device is split into (the pipeline strategy's --pp)
    holds_finished_rows: ClassVar[bool] = False  # a finished request keeps its slot until the batch ends (static)
    policy: Policy  # the scheduling policy: each concrete strategy builds its own after the runtime

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 clock: Clock | None = None, *, role: Role | None = None) -> None:
        super().__init__(model_cfg, model, config, clock)
        self.role = role  # one worker of a fleet (its KV transceiver role), or None
        self.label = role.label if role is not None else self.name
        self.nvtx = Nvtx(config.instrument)
        c = config
        sizes = engine_sizes(c, self.max_tokens_per_step(), self.depth)
        if c.device == "sim":
            from strategies.runtime.sim.build import sim_engine

            self.stream, self.engine = sim_engine(model_cfg, c.sim, self.clock, self.nvtx, sizes, self.pipeline_stages,
                                                  c.speculative)
        elif self.separate_processes:
            self.stream, self.engine = self._process_engine(sizes)
        else:
            self.stream, self.engine = self._local_engine(sizes)
        self.stream.ready()  # the engine's tensors exist: the device orders its work after their fills
        self.core = EngineCore(self, self.engine.buffer_sets, self.depth)
        self.slots = SlotManager(c.max_batch_size)
        self.progress = SlotProgress(c.max_batch_size)  # running requests' counters and tokens, per slot
        self.kv = BlockManager(c.total_kv_blocks, c.tokens_per_block, c.max_batch_size, c.max_blocks_per_seq,
                               c.prefix_caching, c.max_beam_width)
        # Encoder–decoder models: the cross-attention KV's blocks, held from admission to the end
        self.cross_kv = BlockManager(c.total_cross_kv_blocks, c.tokens_per_block, c.max_batch_size,
                                     c.max_blocks_per_seq) if model_cfg.is_encoder_decoder else None
        self.waiting: deque[Request] = deque()
        self.running = RunningRequests(c.max_batch_size)  # admission order, each request's slot beside it
        self._admissions = 0
        self._scheduling = -1  # the iteration whose schedule runs now (admissions start their slot tenure there)
        self.last_scheduled = -1  # the last iteration scheduled with work: a release's last computed step
        self._phase = HostPhase(self)  # ``with self._phase(rec, "schedule"):`` times a host phase into rec
        self.recorder = StepRecorder(self.clock, self.slots, self.kv, self.waiting, self.records,
                                     role.label if role is not None else "")
        if role is not None:
            role.attach(self)
        self.drafter: DraftModel | None = None
        try:
            self.drafter = build_drafter(c, model_cfg, self._local_engine)  # (its own model: no role's extras)
        except BaseException:
            self.close()
            raise

    def run(self, source: RequestSource) -> None:
        self.source = source
        self.core.run()

    def close(self) -> None:
        """Stop the device streams and drop the device's tensors: nothing of it stays on the card."""
        if getattr(self, "drafter", None) is not None:
            self.drafter.close()
            self.drafter = None
        self.stream.close()
        self.slots.close_open(self.last_scheduled)
        self.engine = None  # type: ignore[assignment]

    def inject_fault(self, iteration: int) -> None:
        self.engine.fault_at_iteration = iteration

    def abort(self, r: Request, reason: str) -> None:
        """End ``r`` now (its client went away): out of the queue, or its slot and blocks given back (static:
        its row stays in the batch as padding). The engine's thread only, between steps."""
        if r.status.terminal:
            return
        if r in self.waiting:
            self.waiting.remove(r)
        elif not self.holds_finished_rows:
            self.release(r, "aborted")
        r.end(Status.FAILED, reason, self.clock.now())
        self.source.on_finished(r)

    def slot_tenures(self) -> list[SlotTenure]:
        return self.slots.tenures

    def _local_engine(self, sizes: dict, cfg: ModelConfig | None = None, model: torch.nn.Module | None = None) -> tuple:
        """(stream, engine) of a device this process drives, for the strategy's model or a draft model's."""
        if cfg is None and self.role is not None:  # the strategy's own engine: what its fleet role adds
            sizes = {**sizes, **self.role.engine_sizes(self.model_cfg, self.config)}
        return local_engine(self.config, self.clock, self.nvtx, sizes, cfg or self.model_cfg,
                            self.model if model is None else model)

    def _process_engine(self, sizes: dict) -> tuple:
        """(stream, engine) of a device made of other processes (pipeline stages)."""
        raise NotImplementedError

    def max_tokens_per_step(self) -> int:
        return self.config.max_num_tokens

    @abstractmethod
    def schedule(self, iteration: int) -> ScheduledBatch: ...

    def rejection(self, r: Request) -> str | None:
        reason = super().rejection(r)
        return reason if reason is not None else self.policy.rejection(r)

    # --- hooks of the engine core (``core/engine_core.py``) -------------------------------------------
    def launching(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> None:
        """``batch`` is about to be launched in ``bufs``."""

    def retired(self, step: Step) -> None:
        """``step`` was postprocessed."""

    def intake(self) -> bool:
        """Move arrived requests into the queue; False once there is nothing left to do."""
        assert self.source is not None
        for r in self.source.poll(self.clock.now()):
            reason = self.rejection(r)
            if reason is None:
                self.waiting.append(r)
            else:
                self._reject(r, reason)
        return bool(self.waiting or self.running or not self.source.exhausted)

    def idle(self) -> None:
        assert self.source is not None
        nxt = self.source.next_arrival_s()
        if nxt is None:
            raise ExecutorStalled(f"{self.label}: nothing schedulable and nothing arriving "
                                  f"({len(self.waiting)} waiting, {len(self.running)} running)")
        self.clock.sleep_until(nxt)

    def _admit(self, r: Request, hits: list[int], reserve_tokens: int) -> None:
        """Give ``r`` a slot, its cached prefix blocks ``hits``, and blocks up to ``reserve_tokens``."""
        slot = self.slots.acquire(r.request_id, self._scheduling, r.width)
        self.adopt(r, slot, len(hits) * self.kv.tokens_per_block, self.clock.now())
        self.kv.admit(slot, hits, reserve_tokens, r.width, r.prompt_len)
        if self.cross_kv is not None:
            self.cross_kv.admit(slot, [], r.encoder_len)

    def adopt(self, r: Request, slot: int, computed: int, now_s: float | None = None) -> None:
        """Run ``r`` from the next schedule in ``slot``, whose blocks hold (or will hold) its first ``computed``
        tokens' KV: a prefix hit, or a disaggregated decode worker's transfer into blocks taken before it."""
        r.admit(slot, self._admissions, computed, now_s, self.progress)
        self._admissions += 1
        self.running.append(r)

    def schedulable(self) -> RunningRequests:
        """The running requests a schedule may give rows: all but, on a prefill worker, the ones whose last
        chunk is launched (under overlap it has not come back yet; they never decode there)."""
        if self.role is None or self.role.decodes or all(r.is_prefilling for r in self.running):
            return self.running
        return self.running.select([r.is_prefilling for r in self.running], len(self.running))

    def release(self, r: Request, end: str = "finished") -> None:
        """Give back ``r``'s slot and blocks; ``end`` (finished | preempted) closes its slot tenure."""
        if r.slot is not None:
            self.kv.release(r.slot, r)
            if self.cross_kv is not None:
                self.cross_kv.release(r.slot, r)
            self.slots.release(r.slot, r.request_id, self.last_scheduled, end)
            r.leave_slot()
        self.running.discard(r)  # (static keeps finished requests' slots; a preempted one is not running)

    def _preempt(self, r: Request) -> None:
        """Free ``r``'s slot and blocks, requeued at the front: it recomputes what it had (max-utilization)."""
        self.release(r, "preempted")
        r.preempt()
        self.waiting.appendleft(r)

    def schedule_step(self, iteration: int) -> tuple[IterationRecord, ScheduledBatch]:
        if self.iteration_hook is not None:
            self.iteration_hook(iteration)
        rec = IterationRecord(iteration)
        self._scheduling = iteration
        with self._phase(rec, "schedule"):
            batch = self.schedule(iteration)
            if self.role is not None:
                self.role.scheduled(batch)
            if self.kv.prefix_caching:  # blocks this step fills become reusable for later steps
                slots, running = self.running.slots, self.running
                for i in self.kv.uncommitted(slots, self.progress.counters[slots, COMPUTED]).tolist():
                    self.kv.commit(running[i].slot, running[i])
            for c in batch.context:  # a prefill's last chunk: its slot decodes from the next step
                if c.samples:
                    self.slots.prefilled(c.request.slot, iteration)
        self.recorder.scheduled(rec, batch)
        if batch:
            self.last_scheduled = iteration
        return rec, batch

    def launch(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> DeviceWork:
        if self.drafter is not None and batch.verify:  # the draft's passes first: the step verifies their tokens
            rec.draft_start_s = self.clock.now()
            self.drafter.propose(batch.verify, self.kv.tables)
            rec.draft_end_s = self.clock.now()
        with self._phase(rec, "prepare"):
            self.engine.prepare(batch, bufs, self.kv.tables, self.cross_kv.table if self.cross_kv else None)
            io = bufs.step  # each row's slot key, as its holder runs now (progress.py: SlotProgress.key)
            io.keys[:io.num_rows] = self.progress.key[io.slots.np[:io.num_rows]] | 1
        work = self.engine.launch(rec.iteration, bufs)
        self.recorder.launched(rec, bufs)
        return work

    def wait(self, rec: IterationRecord, work: DeviceWork) -> None:
        self.recorder.waited(rec, work, self.stream.wait(work))

    def postprocess(self, rec: IterationRecord, bufs: BufferSet) -> None:
        """Hand each sampled token to its request; finish the ones the device says are done
        (``core/postprocess.py``)."""
        with self._phase(rec, "postprocess"):
            hand_out(self, rec, bufs)

    def finish(self, r: Request, reason: str) -> None:
        """``r`` is done (``reason``): its slot and blocks go back (static: at its batch's end)."""
        if not self.holds_finished_rows:  # (static: the row stays in its batch, as padding, to the batch's end)
            self.release(r)
        if r.status is Status.WAITING and r in self.waiting:  # overlap: preempted with its last token on the device
            self.waiting.remove(r)
        r.end(Status.FINISHED, reason)
        assert self.source is not None
        self.source.on_finished(r)

