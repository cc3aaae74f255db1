"""Iteration-level scheduling with capacity policies, shared by the in-flight and overlap strategies.

Each call builds one iteration: running requests first (oldest first: a context chunk or one
generation token each), then admissions from the head of the queue into free slots while the token
budget, the batch size and the KV policy allow.

- guaranteed-no-evict: a request is admitted only if the blocks it needs to completion are free; they
  are reserved at admission, so nothing is ever evicted.
- max-utilization: a request is admitted if its current need fits; when a running request cannot grow,
  the most recently admitted request is preempted (slot and blocks freed, requeued at the front) and
  later recomputes its prompt plus the tokens it had generated. Sampling is counter-based, so its
  tokens come out unchanged.
"""

from __future__ import annotations

from collections import deque

from strategies.config import ExecutorConfig
from strategies.runtime.batch import ContextChunk, GenerationStep, ScheduledBatch
from strategies.runtime.kv_cache import KVCacheManager
from strategies.runtime.request import Request


class IterationScheduler:
    def __init__(self, config: ExecutorConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.guaranteed = config.capacity_policy == "guaranteed-no-evict"

    def schedule(self, iteration: int, waiting: deque[Request], running: list[Request], free_slots: int,
                 admit: callable, preempt: callable) -> ScheduledBatch:
        """``admit(request, tokens_to_reserve)`` takes a slot; ``preempt(request)`` gives it back."""
        batch = ScheduledBatch(iteration)
        budget = self.config.max_num_tokens
        for r in list(running):
            if r not in running:  # preempted earlier in this loop
                continue
            n = self._next_tokens(r, budget)
            if n == 0:
                continue
            if not self.guaranteed and not self._make_room(r, r.num_computed_tokens + n, running, batch, preempt):
                continue
            self.kv.grow(r.request_id, r.num_computed_tokens + n)
            budget -= self._add(batch, r, n)
        rows = len(batch.context) + len(batch.generation)
        while waiting and free_slots > 0 and rows < self.config.max_batch_size and budget > 0:
            r = waiting[0]
            if r.pending_samples:  # preempted with a token still on the device: resume once it lands
                break
            n = min(r.prompt_len + r.num_output_tokens, budget)
            if n < r.prompt_len + r.num_output_tokens and not self._may_chunk(r):
                break
            reserve = r.prompt_len + r.max_new_tokens if self.guaranteed else n
            if not self.kv.can_grow(r.request_id, reserve):
                break
            waiting.popleft()
            admit(r, reserve)
            batch.admitted.append(r)
            free_slots -= 1
            rows += 1
            budget -= self._add(batch, r, n)
        return batch

    def _may_chunk(self, r: Request) -> bool:
        # A resumed request recomputes prompt + outputs, which may exceed the budget: always chunk it.
        return self.config.chunked_prefill or r.preemptions > 0

    def _next_tokens(self, r: Request, budget: int) -> int:
        if r.is_prefilling:
            n = r.context_target - r.num_computed_tokens
            if n > budget:
                return budget if self._may_chunk(r) else 0
            return n
        return 1 if r.wants_more_samples and budget >= 1 else 0

    def _make_room(self, r: Request, tokens: int, running: list[Request], batch: ScheduledBatch,
                   preempt: callable) -> bool:
        """Preempt the most recently admitted requests until ``r`` can hold ``tokens``; False if that
        meant preempting ``r`` itself."""
        while not self.kv.can_grow(r.request_id, tokens):
            victim = max(running, key=lambda x: x.admitted_seq)
            preempt(victim)
            batch.preempted.append(victim)
            if victim is r:
                return False
        return True

    @staticmethod
    def _add(batch: ScheduledBatch, r: Request, n: int) -> int:
        if r.is_prefilling:
            samples = r.num_computed_tokens + n == r.context_target
            batch.context.append(ContextChunk(r, r.num_computed_tokens, n, samples))
        else:
            samples = True
            batch.generation.append(GenerationStep(r, r.num_computed_tokens))
        r.num_computed_tokens += n
        r.pending_samples += samples
        return n
