"""Overlap scheduling: the in-flight policy, with postprocess moved one iteration later in the loop.

The host schedules and prepares step n+1 and launches it before it waits for step n (the engine core's depth
2, ``strategies/core/engine_core.py``: vLLM's async scheduling), then processes
n's tokens while the device runs n+1. Generation inputs of n+1 are read on the device from the tokens
sampled at n, and the two steps use different buffer sets. The host learns of a finish one step late:
a request that hit a stop token at n is computed once more at n+1, that token is discarded, and its
slot is released one iteration later. Length finishes are known in advance: once a request's last
token is launched its slot and blocks go back at the next schedule, before that token is read — safe
because the device runs steps in order, so a new owner's admission lands after the old step. A beam
request keeps its slot until its finish is read: its hypotheses are read back from the slot then.

Speculation: a request whose token of step n is still on the device drafts past a guess of it (n-gram:
``speculation.propose_drafts``; a draft model: ``spec/draft_model.py``) while n runs; the device verifies
them after the real token. A request verifying in step n sits step n + 1 out, as its next position is known
only once n's outputs are read.
"""

from __future__ import annotations

from strategies.base import Strategy
from strategies.running import RunningRequests
from strategies.runtime.progress import COMPUTED, MAX_NEW, SCHEDULED, TARGET
from strategies.scheduler import IterationScheduler


class OverlapStrategy(Strategy):
    name = "overlap"
    depth = 2  # step n+1 is launched before step n is waited for
    speculates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler.policy = IterationScheduler(self.config, self.kv, self.progress, self.cross_kv)

    def schedulable(self) -> RunningRequests:
        """Before each schedule, the early release: a request whose last token is launched but not yet read
        gives its slot and blocks back now (length finishes are known in advance)."""
        running = self.running
        if running:
            c = self.progress.counters[running.slots]  # [N, 6] (one array test a step, not a request's properties)
            all_sent = (c[:, COMPUTED] >= c[:, TARGET]) & (c[:, SCHEDULED] >= c[:, MAX_NEW])  # [N]
            for r in [running[i] for i in all_sent.nonzero()[0].tolist()]:
                if r.width == 1:
                    self.scheduler.release(r)
        return super().schedulable()
