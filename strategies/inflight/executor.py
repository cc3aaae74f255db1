"""In-flight batching: iteration-level scheduling; each request holds a slot from admission to finish.

Every iteration admits waiting requests into free slots, runs context and generation requests in one
forward, and releases a slot in the iteration its request finishes. The host waits for each step before
it schedules the next one. The policy is the iteration scheduler (``strategies/scheduler.py``); a fleet's
worker is this strategy given a role (``strategies/fleet.py``, ``strategies/disagg/workers.py``).
"""

from __future__ import annotations

from strategies.base import Strategy
from strategies.runtime.batch import ScheduledBatch
from strategies.scheduler import IterationScheduler


class InflightStrategy(Strategy):
    name = "inflight"
    speculates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy = IterationScheduler(self.config, self.kv, self.cross_kv, self.progress)

    def schedule(self, iteration: int) -> ScheduledBatch:
        return self.policy.schedule(iteration, self.waiting, self.running, self.slots.num_free, self._admit,
                                    self._preempt)

    def _loop(self) -> None:
        """schedule → launch → wait → postprocess, one step at a time."""
        bufs = self.engine.buffer_sets[0]
        iteration = 0
        while self._intake():
            self.nvtx.push("iteration")
            rec, batch = self._schedule_phase(iteration)
            if batch:
                self._step(rec, batch, bufs)
                iteration += 1
            self.nvtx.pop()
            if not batch:
                self._idle()
