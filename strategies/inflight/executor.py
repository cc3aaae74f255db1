"""In-flight batching: iteration-level scheduling; each request holds a slot from admission to finish.

Every iteration admits waiting requests into free slots, runs context and generation requests in one
forward, and releases a slot in the iteration its request finishes. The host waits for each step
before scheduling the next one: the loop is ``Strategy._loop``, the synchronous arrangement.
"""

from __future__ import annotations

from strategies.drafting import DraftingStrategy
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.request import Request
from strategies.scheduler import IterationScheduler


class InflightStrategy(DraftingStrategy):
    name = "inflight"
    speculates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler = IterationScheduler(self.config, self.kv, self.cross_kv, self.progress)
        # max-utilization takes blocks as tokens need them, so those past rejected drafts go back at once;
        # guaranteed-no-evict's are the request's reservation to its end (static's: to its batch's end)
        self.trims_rejected_kv = not self.scheduler.guaranteed
        self._start_drafter()

    def schedule(self, iteration: int) -> ScheduledBatch:
        return self.scheduler.schedule(iteration, self.waiting, self.running, self.slots.num_free,
                                       self._admit, self._preempt)

    def rejection(self, r: Request) -> str | None:
        reason = super().rejection(r)
        need = r.prompt_len + r.encoder_len  # an encoder input runs in the step that admits its request
        if reason is None and not self.config.chunked_prefill and need > self.config.max_num_tokens:
            reason = (f"prompt ({need} tokens, encoder input included) exceeds max_num_tokens "
                      f"({self.config.max_num_tokens}) without chunked prefill")
        return reason

    def _preempt(self, r: Request) -> None:
        self._release(r, "preempted")
        r.preempt()
        self.waiting.appendleft(r)
