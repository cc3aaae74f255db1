"""Static batching: a batch is formed only when the executor is idle and runs until all of it is done.

Prompts are padded to the longest in the batch, and rows whose request has finished keep computing as
padding until the last one is done (as FasterTransformer and ``generate`` do). Nothing is admitted
mid-batch; slots and KV blocks are returned when the batch ends.
"""

from __future__ import annotations

from strategies.base import Strategy, register
from strategies.runtime.batch import ContextChunk, GenerationStep, ScheduledBatch
from strategies.runtime.request import Request, Status


@register
class StaticStrategy(Strategy):
    name = "static"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch: list[Request] = []

    def max_tokens_per_step(self) -> int:
        # The padded prefill of a full batch: static batching has no per-iteration token budget.
        return self.config.max_batch_size * self.config.max_seq_len

    def schedule(self, iteration: int) -> ScheduledBatch:
        if self.batch:
            return self._decode_step(iteration)
        batch = ScheduledBatch(iteration)
        while self.waiting and len(self.batch) < self.config.max_batch_size:
            r = self.waiting[0]
            reserve = r.prompt_len + r.max_new_tokens
            if not self.kv.can_grow(r.request_id, reserve):
                break
            self.waiting.popleft()
            self._admit(r, reserve)
            self.batch.append(r)
            batch.admitted.append(r)
        longest = max((r.prompt_len for r in self.batch), default=0)
        for r in self.batch:
            batch.context.append(ContextChunk(r, 0, r.prompt_len, True, padding=longest - r.prompt_len))
            r.num_computed_tokens = r.prompt_len
            r.pending_samples += 1
        return batch

    def _decode_step(self, iteration: int) -> ScheduledBatch:
        batch = ScheduledBatch(iteration)
        last = self.config.max_seq_len - 1
        for r in self.batch:
            done = r.status.terminal
            batch.generation.append(GenerationStep(r, min(r.num_computed_tokens, last), padding=done))
            r.num_computed_tokens += 1
            r.pending_samples += 1
        return batch

    def _finish(self, r: Request, reason: str) -> None:
        # The row stays in the batch (as padding) and keeps its slot until the whole batch is done.
        r.end(Status.FINISHED, reason)
        assert self.source is not None
        self.source.on_finished(r)

    def _after_step(self) -> None:
        if all(r.status.terminal for r in self.batch):
            for r in self.batch:
                self._release(r)
            self.batch = []
