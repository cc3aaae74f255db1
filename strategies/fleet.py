"""Several engines behind one host loop: a strategy's steps on N devices at once.

A fleet's workers are in-flight (or overlap) strategies, each given a role (``ReplicaRole``; disagg's prefill and
decode roles) and each with an engine, slots, KV pool and device stream of its own
(on the simulated device each is a GPU, or a TP group, of its own on one virtual clock). The fleet drives each
worker's engine core (``core/engine_core.py``) through its public calls: every worker with room in its step
queue schedules and launches its next step, then the host takes whichever due step finishes first and
postprocesses it — the engine core's loop, spread over the workers. Two fleets:

- ``Replicas`` (``--num-replicas N`` with inflight): N colocated engines behind a router that sends each
  arrival to the replica with the fewest tokens still to compute, or to each in turn (``--router``) — the
  equal-GPU baseline that disaggregated serving is measured against.
- ``DisaggStrategy`` (``strategies/disagg/``): prefill and decode workers with a KV transceiver between them.

A worker that fails (its device raised) fails its own requests with the reason; the others finish, and the
run then ends with the first failure (exit 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from strategies.base import Strategy
from strategies.config import ExecutorConfig
from strategies.core.engine_core import Step
from strategies.core.replica_role import ReplicaRole
from strategies.inflight.executor import InflightStrategy
from strategies.interface import Executor, ExecutorStalled, RequestSource
from strategies.runtime.buffers.slots import SlotTenure
from strategies.runtime.device.clock import Clock
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request, Status

if TYPE_CHECKING:
    import torch

    from strategies.runtime.iteration import IterationRecord

POLL_S = 2e-4  # real devices, several steps in flight: how often the host looks for one that is done


Worker = Strategy  # a fleet's worker: the in-flight or overlap strategy given a role (``role``), not a subclass


class Fleet(Executor):
    """The loop over several workers; subclasses build them and say where arrivals go."""

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 clock: Clock | None = None) -> None:
        super().__init__(model_cfg, model, config, clock)
        if model_cfg.is_encoder_decoder:
            raise ValueError(f"{self.name}: the workers run decoder-only (Llama-style) models")
        self.workers: list[Worker] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.alive: list[Worker] = list(self.workers)
        self.error: str | None = None  # the first worker failure
        self.faults: list[dict] = []  # each worker's death: who, when (run clock), why, and how it was found
        self._routed = 0  # arrivals routed so far (round-robin's turn)

    def _build(self) -> None:
        """Append the workers to ``self.workers``."""
        raise NotImplementedError

    def entry(self) -> list[Worker]:
        """The live workers an arrival may go to."""
        return self.alive

    # --- interface --------------------------------------------------------------------------------
    def rejection(self, r: Request) -> str | None:
        if r.width > 1:
            return f"{self.name}: beam search is not supported"
        return self.workers[0].rejection(r)

    def slot_tenures(self) -> list[SlotTenure]:
        return [t for w in self.workers for t in w.slots.tenures]

    def abort(self, r: Request, reason: str) -> None:
        """End ``r`` on the worker that queues or runs it; one between workers (disagg's handoff, a transfer)
        runs on to its end."""
        for w in self.alive:
            if r in w.waiting or r in w.running:
                w.abort(r, reason)
                return

    def extras(self) -> dict:
        return {"faults": self.faults} if self.faults else {}

    def take_history(self) -> tuple[list[IterationRecord], list[SlotTenure]]:
        records, tenures = [], []
        for w in self.workers:
            done, ended = w.take_history()
            for t in ended:
                t.worker = w.label
            records += done
            tenures += ended
        return sorted(records, key=lambda rec: rec.schedule_start_s), tenures

    def close(self) -> None:
        for w in self.workers:
            w.close()
            for t in w.slots.tenures:
                t.worker = w.label
        self.records = sorted((rec for w in self.workers for rec in w.records), key=lambda rec: rec.schedule_start_s)

    def run(self, source: RequestSource) -> None:
        self.source = source
        for w in self.workers:
            w.take_from(source)
        while self._intake() or any(w.core.queue for w in self.alive) or self._pending():
            self._between_steps()
            due: dict[Worker, Step] = {}  # each worker's oldest step, where it must be waited for (``due``)
            launched = False
            for w in self.alive:
                if w.core.has_room:
                    step = w.core.launch_next()
                    launched |= step is not None
                    if not w.core.due(step):
                        continue
                if w.core.queue:
                    due[w] = w.core.queue[0]
            if launched and not due:  # a step of depth > 1 went in: schedule the next before waiting on anything
                continue
            if due or self._events_pending():
                w = self._next_done(due)
                if w is not None:
                    self._finish(w)
            elif not launched:  # nothing runs: only an arrival can bring work
                self._idle()
        if self.error is not None:
            raise RuntimeError(self.error)

    # --- hooks (disaggregation's transceiver) ---------------------------------------------------------
    def _pending(self) -> bool:
        """Work outside the workers' queues (requests between workers)."""
        return False

    def _events_pending(self) -> bool:
        """Something other than a step will happen without the host (a transfer in flight)."""
        return False

    def _next_event_s(self) -> float:
        """Simulated device: when the next such event happens."""
        return float("inf")

    def _between_steps(self) -> None:
        """Runs each time round the loop, before idle workers schedule."""

    def _after_step(self, w: Worker) -> None:
        """Runs after ``w``'s step is postprocessed."""

    # --- the loop's parts ---------------------------------------------------------------------------
    def _intake(self) -> bool:
        """Route arrived requests to the entry worker with the least work (a dead one is seen first)."""
        assert self.source is not None
        self._check_health()
        for r in self.source.poll(self.clock.now()):
            reason = self.rejection(r)
            if reason is None:
                self._route().scheduler.add(r)
            else:
                self._reject(r, reason)
        return any(w.waiting or w.running for w in self.alive) or not self.source.exhausted

    def _route(self) -> Worker:
        """The entry worker for the next arrival (``--router``)."""
        entry = self.entry()
        self._routed += 1
        if self.config.router == "round-robin":
            return entry[(self._routed - 1) % len(entry)]
        return min(entry, key=_load)

    def _finish(self, w: Worker) -> None:
        try:
            w.core.finish_oldest()
        except Exception as exc:  # the worker's device failed: its requests fail, the others go on
            self._died(w, exc)
            return
        self._after_step(w)

    def _next_done(self, steps: dict[Worker, Step]) -> Worker | None:
        """The worker whose step to postprocess next, or None when the loop should go round first (another
        event came first, or an arrival for an idle entry worker)."""
        assert self.source is not None
        idle_entry = any(w not in steps for w in self.entry())
        if self.config.device == "sim":  # every end is known: take the earliest event on the virtual clock
            ends = {w: max(t for _, t in s.work.times.values()) for w, s in steps.items()}
            first = min(ends.values(), default=float("inf"))
            nxt = self.source.next_arrival_s() if idle_entry else None
            event = self._next_event_s()
            if nxt is not None and nxt < min(first, event):
                self.clock.sleep_until(nxt)
                return None
            if event < first:
                self.clock.sleep_until(event)
                return None
            return min(ends, key=ends.__getitem__)
        for w, step in steps.items():
            if w.stream.query(step.work):
                return w
        if len(steps) == 1 and not self._events_pending() and not idle_entry:
            return next(iter(steps))  # nothing else can happen before it ends: block on it
        time.sleep(POLL_S)
        return None

    def _idle(self) -> None:
        assert self.source is not None
        nxt = self.source.next_arrival_s()
        if nxt is None:
            raise ExecutorStalled(f"{self.name}: nothing schedulable and nothing arriving")
        self.clock.sleep_until(nxt)

    def _check_health(self) -> None:
        """Between steps, every live worker's device is asked whether it is gone (a device process that exited),
        idle ones too: a dead worker stops taking arrivals at once, not when work is next routed to it."""
        for w in list(self.alive):
            exc = w.stream.fault()
            if exc is not None:
                self._died(w, exc, "health check")

    def _died(self, w: Worker, exc: BaseException, found: str = "step") -> None:
        if w not in self.alive:  # already failed (a transfer's piece, then its step in flight)
            return
        reason = f"{w.label} failed: {type(exc).__name__}: {exc}"
        self.error = self.error or reason
        self.alive.remove(w)
        now = self.clock.now()
        self.faults.append({"worker": w.label, "time_s": now, "cause": f"{type(exc).__name__}: {exc}", "found": found})
        failed = {id(r): r for r in [*self._forget(w), *w.role.fail_all(reason)]}
        assert self.source is not None
        for r in failed.values():
            if r.status is not Status.FAILED:
                r.end(Status.FAILED, reason, now)
            self.source.on_finished(r)
        for kind in {x.role.kind for x in self.workers}:
            if not any(x.role.kind == kind for x in self.alive):
                raise RuntimeError(f"{reason}; no {kind} worker left")

    def _forget(self, w: Worker) -> list[Request]:
        """Requests lost with ``w`` outside its own queues (before its queues are failed)."""
        return []


def _load(w: Worker) -> int:
    return w.role.load()


class Replicas(Fleet):
    """N colocated in-flight engines behind a least-outstanding-tokens router (``--num-replicas``)."""

    name = "inflight"

    def _build(self) -> None:
        for i in range(self.config.num_replicas):
            self.workers.append(InflightStrategy(self.model_cfg, self.model, self.config.on(i), self.clock,
                                                 role=ReplicaRole(i)))

    def inject_fault(self, iteration: int) -> None:
        """The harness's fault hook: replica 0's device fails at its step ``iteration``."""
        self.workers[0].inject_fault(iteration)


def replicated(cls: type[Executor]) -> Callable[..., Executor]:
    """``cls`` as N replicas (``config.num_replicas``): only the in-flight strategy has a fleet."""
    if cls is not InflightStrategy:
        raise ValueError(f"--num-replicas: {cls.name} runs one engine here (inflight runs N)")
    return Replicas
