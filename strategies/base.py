"""A slotbench strategy: the shared runtime, the three parts of a step — schedule (host) → forward + sample
(device) → postprocess (host) — and the parts a strategy is given (``parts.py``): a scheduling ``policy``, a
``drafter`` (``drafting.py``), a fleet ``role`` (``fleet.py``, ``disagg/workers.py``), a ``recorder``. The loop
is the engine core's (``core/engine_core.py``), the same for all: a concrete strategy subclasses ``Strategy``
once and says its depth (steps in flight), its policy and its hooks. The runtime underneath is the same for all,
so a difference between strategies in a report comes from scheduling alone.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, ClassVar

from strategies.config import ExecutorConfig
from strategies.core.engine_core import EngineCore, Step
from strategies.core.local_engine import engine_sizes, local_engine
from strategies.core.scheduler import Scheduler
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
from strategies.runtime.iteration import IterationRecord, take_done
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.progress import SlotProgress
from strategies.runtime.request import Request

if TYPE_CHECKING:
    import torch

    from strategies.runtime.spec.draft_model import DraftModel


class Strategy(Executor):
    """A slotbench executor: the shared runtime, a scheduler that owns the requests, and the engine core's loop of
    schedule → launch → wait → postprocess, ``depth`` steps in flight."""

    depth: ClassVar[int] = 1  # steps in flight (each in a buffer set of its own): the engine core's queue
    separate_processes: ClassVar[bool] = False  # the device is other processes (pipeline stages)
    pipeline_stages: ClassVar[int] = 1  # stages the device is split into (the pipeline strategy's --pp)
    holds_finished_rows: ClassVar[bool] = False  # a finished request keeps its slot until the batch ends (static)

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
        # the requests and what they hold (queue, running list, slots, progress book, KV pools); the concrete
        # strategy gives it its policy
        self.scheduler = Scheduler(c, self.clock, model_cfg.is_encoder_decoder, self.holds_finished_rows)
        self._phase = HostPhase(self)  # ``with self._phase(rec, "schedule"):`` times a host phase into rec
        self.recorder = StepRecorder(self.clock, self.slots, self.kv, self.waiting, self.records,
                                     role.label if role is not None else "", self.engine.kv_block_bytes)
        if role is not None:
            role.attach(self)
        self.drafter: DraftModel | None = None
        try:
            self.drafter = build_drafter(c, model_cfg, self._local_engine)  # (its own model: no role's extras)
        except BaseException:
            self.close()
            raise

    def run(self, source: RequestSource) -> None:
        self.take_from(source)
        self.core.run()

    def take_from(self, source: RequestSource) -> None:
        """Serve ``source``'s requests and tell it of each end (a fleet's worker: the fleet's source)."""
        self.source = source
        self.scheduler.on_finished = source.on_finished

    def close(self) -> None:
        """Stop the device streams and drop the device's tensors: nothing of it stays on the card."""
        if getattr(self, "drafter", None) is not None:
            self.drafter.close()
            self.drafter = None
        self.stream.close()
        self.slots.close_open(self.scheduler.last_scheduled)
        self.engine = None  # type: ignore[assignment]

    def inject_fault(self, iteration: int) -> None:
        self.engine.fault_at_iteration = iteration

    def abort(self, r: Request, reason: str) -> None:
        """End ``r`` now (its client went away); the engine's thread only, between steps."""
        self.scheduler.abort(r, reason)

    # --- the scheduler's state, read (``core/scheduler.py`` owns it and changes it) -----------------------
    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> RunningRequests:
        return self.scheduler.running

    @property
    def slots(self) -> SlotManager:
        return self.scheduler.slots

    @property
    def kv(self) -> BlockManager:
        return self.scheduler.kv

    @property
    def cross_kv(self) -> BlockManager | None:
        return self.scheduler.cross_kv

    @property
    def progress(self) -> SlotProgress:
        return self.scheduler.progress

    def slot_tenures(self) -> list[SlotTenure]:
        return self.slots.tenures

    def take_history(self) -> tuple[list[IterationRecord], list[SlotTenure]]:
        return take_done(self.records), self.slots.take_closed()

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
                self.scheduler.add(r)
            else:
                self._reject(r, reason)
        return self.scheduler.has_work() or not self.source.exhausted

    def idle(self) -> None:
        assert self.source is not None
        nxt = self.source.next_arrival_s()
        if nxt is None:
            raise ExecutorStalled(f"{self.label}: nothing schedulable and nothing arriving "
                                  f"({len(self.waiting)} waiting, {len(self.running)} running)")
        self.clock.sleep_until(nxt)

    def schedulable(self) -> RunningRequests:
        """Hook: the running requests the next schedule may give rows — all but, on a prefill worker, the ones
        whose last chunk is launched (under overlap it has not come back yet; they never decode there)."""
        if self.role is None or self.role.decodes or all(r.is_prefilling for r in self.running):
            return self.running
        return self.running.select([r.is_prefilling for r in self.running], len(self.running))

    def schedule_step(self, iteration: int) -> tuple[IterationRecord, ScheduledBatch]:
        if self.iteration_hook is not None:
            self.iteration_hook(iteration)
        rec = IterationRecord(iteration)
        with self._phase(rec, "schedule"):
            batch = self.scheduler.schedule(iteration, self.schedulable())
            if self.role is not None:
                self.role.scheduled(batch)
        self.recorder.scheduled(rec, batch)
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
            self.scheduler.update_from_output(rec, bufs, self.engine)
