"""Static batching: schedule a batch when none runs, then step it until every row is done, then give back
its slots and blocks. The policy — padding, whole-row prefills, finished rows computed as padding — is
``static/batcher.py``'s.
"""

from __future__ import annotations

from strategies.base import Strategy
from strategies.core.engine_core import Step
from strategies.static.batcher import StaticBatcher


class StaticStrategy(Strategy):
    name = "static"
    speculates = True
    holds_finished_rows = True  # a finished row stays in its batch, as padding, and keeps its slot

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler.policy = StaticBatcher(self.config, self.kv, self.cross_kv)

    def max_tokens_per_step(self) -> int:
        # a prompt longer than the token budget prefills alone, whole: static batching cannot chunk a row
        return max(self.config.max_num_tokens, self.config.max_batch_size, self.config.max_seq_len)

    def retired(self, step: Step) -> None:
        """The engine core's depth 1: after each step, the batch may end: its slots and blocks go back."""
        if self.policy.batch and self.policy.done:
            for r in self.policy.batch:
                self.scheduler.release(r)
            self.policy.batch = []
