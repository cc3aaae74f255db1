"""In-flight batching: iteration-level scheduling; each request holds a slot from admission to finish.

Every iteration admits waiting requests into free slots, runs context and generation requests in one
forward, and releases a slot in the iteration its request finishes. The host waits for each step before
it schedules the next one: the engine core's depth 1 (``strategies/core/engine_core.py``). The policy is the
iteration scheduler (``strategies/scheduler.py``); a fleet's worker is this strategy given a role
(``strategies/fleet.py``, ``strategies/disagg/workers.py``).
"""

from __future__ import annotations

from strategies.base import Strategy
from strategies.scheduler import IterationScheduler


class InflightStrategy(Strategy):
    name = "inflight"
    speculates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler.policy = IterationScheduler(self.config, self.kv, self.progress, self.cross_kv)
