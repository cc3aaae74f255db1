"""A strategy as one engine of a fleet (``strategies/fleet.py``): the role a fleet gives each of its workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.config import ExecutorConfig
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request, Status

if TYPE_CHECKING:
    from strategies.base import Strategy as Worker


class ReplicaRole:
    """The part that makes an in-flight (or overlap) strategy one engine of a fleet: its label, and what the
    fleet asks of it (its requests, its load for the router, failing them when it dies). Disagg's
    prefill and decode roles add the KV transceiver's side (``strategies/disagg/workers.py``)."""

    kind = "replica"
    decodes = True  # its worker computes every token of a request

    def __init__(self, index: int = 0) -> None:
        self.label = f"{self.kind}{index}"  # records' ``worker`` column
        self.worker: Worker  # the strategy this role is part of (``attach``)

    def attach(self, worker: Worker) -> None:
        """Called once, when ``worker``'s runtime exists."""
        self.worker = worker

    def engine_sizes(self, model_cfg: ModelConfig, config: ExecutorConfig) -> dict[str, int]:
        """Engine sizes the role adds (a KV staging buffer)."""
        return {}

    def scheduled(self, batch: ScheduledBatch) -> None:
        """Called as each of the worker's schedules returns ``batch``."""

    def requests(self) -> list[Request]:
        """Every request this worker holds or queues, whatever its state: its queue, its running list, and the
        rows of its steps in flight (an overlap worker releases a request early, its last token still there)."""
        w = self.worker
        held = {id(r): r for r in (*w.waiting, *w.running)}
        for step in w.core.queue:
            held.update((id(r), r) for r in step.bufs.step.rows if not r.status.terminal)
        return list(held.values())

    def load(self) -> int:
        """Tokens still to compute for what it queues and runs: the router's measure (a request released early
        has nothing left to compute; ``requests`` would count it whole)."""
        w = self.worker
        return sum(r.context_target - r.num_computed_tokens + r.max_new_tokens - r.num_scheduled_samples
                   if r.slot is not None else r.prompt_len + r.max_new_tokens for r in (*w.waiting, *w.running))

    def fail_all(self, reason: str) -> list[Request]:
        """The worker died: its requests end failed, in the records as they stood."""
        failed = [r for r in self.requests() if not r.status.terminal]
        w = self.worker
        now = w.clock.now()
        for r in failed:
            r.end(Status.FAILED, reason, now)
        w.scheduler.drop_all()
        return failed
