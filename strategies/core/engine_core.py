"""One engine core: schedule → launch → a queue of up to ``depth`` steps in flight → wait → postprocess.

Every strategy runs this loop (vLLM's ``EngineCore.step_with_batch_queue``, SGLang's ``result_queue``); what
differs is the depth and a few hooks:

- static and inflight: depth 1 — each step is waited for before the next is scheduled;
- overlap: depth 2 — step n+1 is scheduled and launched before step n is waited for (vLLM's async scheduling,
  ``max_concurrent_batches`` = 2);
- pipeline: depth M, the micro-batches in flight (vLLM: the pipeline-parallel size).

Each turn schedules a step and launches it; when the queue holds ``depth`` steps, or nothing was launched, the
oldest is waited for and postprocessed. With nothing launched and nothing in flight, the engine waits for an
arrival. A fleet (``strategies/fleet.py``) drives several cores itself through ``launch_next`` and
``finish_oldest``, each core keeping its own queue and depth.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strategies.runtime.batch import ScheduledBatch
    from strategies.runtime.buffers.buffer_set import BufferSet
    from strategies.runtime.device.nvtx import Nvtx
    from strategies.runtime.device.stream import DeviceWork
    from strategies.runtime.iteration import IterationRecord


@dataclass(slots=True)
class Step:
    """A launched step: its record, the device's handle on it, and the buffer set it runs in."""

    record: IterationRecord
    work: DeviceWork
    bufs: BufferSet


class StepParts(Protocol):
    """The parts of a step a core arranges (``strategies/base.py``'s ``Strategy``) and its hooks."""

    nvtx: Nvtx

    def intake(self) -> bool:
        """Take arrived requests; False once nothing is left to do."""

    def idle(self) -> None:
        """Nothing to run: wait for the next arrival."""

    def schedule_step(self, iteration: int) -> tuple[IterationRecord, ScheduledBatch]: ...

    def launch(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> DeviceWork: ...

    def wait(self, rec: IterationRecord, work: DeviceWork) -> None: ...

    def postprocess(self, rec: IterationRecord, bufs: BufferSet) -> None: ...

    def launching(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> None:
        """Hook: ``batch`` is about to be launched in ``bufs`` (pipeline: its requests are in flight)."""

    def retired(self, step: Step) -> None:
        """Hook: ``step`` was postprocessed (static: a batch's end; pipeline: its requests are back)."""


class EngineCore:
    """The step queue of one engine and the loop that fills and drains it."""

    def __init__(self, parts: StepParts, buffer_sets: list[BufferSet], depth: int) -> None:
        if depth < 1 or depth > len(buffer_sets):
            raise ValueError(f"depth {depth}: a step in flight needs a buffer set of its own ({len(buffer_sets)})")
        self.parts = parts
        self.buffer_sets = buffer_sets
        self.depth = depth
        self.queue: deque[Step] = deque()  # launched, not yet postprocessed: oldest first
        self.iteration = 0  # the number the next scheduled step gets (each engine numbers its own)

    @property
    def has_room(self) -> bool:
        """Another step may be launched before the oldest is waited for."""
        return len(self.queue) < self.depth

    def launch_next(self) -> Step | None:
        """Schedule the next step and launch it into the queue; None (nothing launched) if it is empty."""
        p = self.parts
        rec, batch = p.schedule_step(self.iteration)
        if not batch:
            return None
        bufs = self.buffer_sets[self.iteration % len(self.buffer_sets)]
        p.launching(rec, batch, bufs)
        step = Step(rec, p.launch(rec, batch, bufs), bufs)
        self.queue.append(step)
        self.iteration += 1
        return step

    def due(self, launched: Step | None) -> bool:
        """The oldest step must be waited for now: the queue is full, or nothing else was launched."""
        return bool(self.queue) and (len(self.queue) >= self.depth or launched is None)

    def finish_oldest(self) -> Step:
        """Wait for the oldest step and postprocess it. It leaves the queue only then: if its device failed, its
        rows are still there for whoever fails this engine's requests (a fleet's role)."""
        step = self.queue[0]
        self.parts.wait(step.record, step.work)
        self.parts.postprocess(step.record, step.bufs)
        self.queue.popleft()
        self.parts.retired(step)
        return step

    def run(self) -> None:
        """The loop, until the parts' intake says nothing is left and no step is in flight."""
        p = self.parts
        while p.intake() or self.queue:
            p.nvtx.push("iteration")
            launched = self.launch_next()
            waited = self.due(launched)
            if waited:
                self.finish_oldest()
            p.nvtx.pop()
            if launched is None and not waited:
                p.idle()
