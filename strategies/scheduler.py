"""Iteration-level scheduling with capacity policies, shared by the in-flight and overlap strategies.

Each call builds one iteration within the token budget: running requests that decode get their one
token first, then running prefills get chunks (vLLM V0's and Sarathi-Serve's order, so a long prompt
never delays a running request's next token; vLLM V1 walks its running requests in admission order, which
differs only where the budget binds), then requests from the head of the queue are admitted
into free slots while the budget, the batch size and the KV policy allow. An admitted request starts
from its longest cached prefix (prefix caching) and computes only the rest.

- guaranteed-no-evict: a request is admitted only if the blocks it needs to completion are free; they
  are taken at admission, so nothing is ever evicted.
- max-utilization (vLLM V1's ``allocate_slots``): a request is admitted if its current need fits, less a
  watermark of free blocks kept back while others run (``--kv-watermark``: 0, as V1; V0 kept 1%);
  when a running request cannot grow, the most recently admitted request is preempted (slot and blocks
  freed, requeued at the front) and later recomputes its prompt plus the tokens it had generated, and
  a step that preempted admits no one (V1's ``if not preempted_reqs``: the room just freed goes to the
  running requests that grow). Sampling is counter-based, so its tokens come out unchanged.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from strategies.config import ExecutorConfig
from strategies.running import RunningRequests
from strategies.runtime.batch import ContextChunk, ScheduledBatch
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.progress import COMPUTED, MAX_NEW, SCHEDULED, TARGET, SlotProgress
from strategies.runtime.request import Request
from strategies.speculation import propose_drafts

if TYPE_CHECKING:
    from strategies.parts import Preempt, Queues


class IterationScheduler:
    def __init__(self, config: ExecutorConfig, kv: BlockManager, book: SlotProgress,
                 cross_kv: BlockManager | None = None) -> None:
        self.config = config
        self.kv = kv
        self.cross_kv = cross_kv  # encoder–decoder models: cross-attention blocks, taken whole at admission
        # The runtime's per-slot progress, whose counters choose the decode rows (``_decode_rows``); with one row
        # and one token a request (no beams, no drafts) they are committed there too
        self.book = book
        self.one_row = config.max_beam_width == 1 and config.speculative is None
        self.guaranteed = config.capacity_policy == "guaranteed-no-evict"
        self.watermark = 0 if self.guaranteed else math.ceil(config.kv_watermark * kv.total_blocks)
        # max-utilization takes blocks as tokens need them, so those past rejected drafts go back at once;
        # guaranteed-no-evict's are the request's reservation to its end
        self.trims_rejected_kv = not self.guaranteed

    def rejection(self, r: Request) -> str | None:
        """Without chunked prefill a prompt (and an encoder input, run in the step that admits its request)
        must fit one step's token budget."""
        need = r.prompt_len + r.encoder_len
        if not self.config.chunked_prefill and need > self.config.max_num_tokens:
            return (f"prompt ({need} tokens, encoder input included) exceeds max_num_tokens "
                    f"({self.config.max_num_tokens}) without chunked prefill")
        return None

    def reservation(self, r: Request, tokens_now: int) -> int:
        """Tokens whose blocks ``r`` takes at admission: all it may reach (guaranteed-no-evict), or what its
        first step computes (max-utilization: it grows as it runs)."""
        return r.prompt_len + r.max_new_tokens if self.guaranteed else tokens_now

    def fits(self, r: Request, hits: list[int], reserve: int, busy: bool) -> bool:
        """Whether ``r``'s admission (cached blocks ``hits``, ``reserve`` tokens) leaves the watermark free while
        others run (``busy``); alone, a request may use the whole cache."""
        spare = self.watermark if busy else 0
        return self.kv.admission_blocks(hits, reserve, r) <= self.kv.free_blocks - spare

    def schedule(self, iteration: int, queues: Queues, running: RunningRequests) -> ScheduledBatch:
        """Step ``iteration`` over ``running`` (the running requests it may give rows) and ``queues``' waiting
        requests (admitted, and running ones preempted, through ``queues``)."""
        waiting, free_slots, preempt = queues.waiting, queues.free_slots, queues.preempt
        batch = ScheduledBatch(iteration)
        tpb = self.kv.tokens_per_block
        budget = self.config.max_num_tokens
        prefills, budget = self._decode_rows(batch, running, budget, preempt)
        for r in prefills:  # then prefill chunks
            if r.slot is None:
                continue
            n = self._next_tokens(r, budget)
            if n == 0:
                continue
            if not self._allocate(r, r.num_computed_tokens + n, running, batch, preempt):
                continue
            budget -= self._add(batch, r, n)
        rows = len(batch.context) + len(batch.gen_requests)
        if self.config.max_beam_width > 1:  # a beam request decodes K rows: count every running request's
            rows = sum(r.width for r in running)
        while waiting and free_slots > 0 and budget > 0 and not batch.preempted:
            r = waiting[0]
            if rows + r.width > self.config.max_batch_size:
                break
            if r.pending_samples:  # preempted with a token still on the device: resume once it lands
                break
            enc = r.encoder_len  # encoded whole in the step that admits it, from the same budget
            if enc and (enc >= budget or self.cross_kv.blocks_for(enc) > self.cross_kv.free_blocks):
                break
            hits = self.kv.prefix_hit(r)
            todo = r.prompt_len + r.num_output_tokens - len(hits) * tpb
            n = min(todo, budget - enc)
            if n < todo and not self._may_chunk(r):
                break
            reserve = self.reservation(r, len(hits) * tpb + n)
            if not self.fits(r, hits, reserve, busy=bool(running)):
                break
            waiting.popleft()
            queues.admit(r, hits, reserve)
            batch.admitted.append(r)
            free_slots -= 1
            rows += r.width
            budget -= enc + self._add(batch, r, n)
        if self.config.max_beam_width == 1:
            batch.no_beams()
        return batch

    def _decode_rows(self, batch: ScheduledBatch, running: RunningRequests, budget: int,
                     preempt: Preempt) -> tuple[list[Request], int]:
        """Decodes first: each running request past its prefill with a token still to ask for gets its row (a
        beam request one per beam, a request with drafts a verifying chunk), in admission order while the budget
        lasts. Chosen over the book's counters, as array operations over the running slots; committed as arrays
        in the common step (one row a request, and no decode's new block would preempt), else request by
        request (``_decode_each``). Returns the requests still prefilling and the budget left."""
        if not running:  # an idle engine's admissions: no row to choose, and no array pass to pay (~10-100 us)
            return [], budget
        slots = running.slots  # [N]
        c = self.book.counters[slots]  # [N, 6]
        computed = c[:, COMPUTED]  # [N]
        decoding = computed >= c[:, TARGET]  # [N]
        wants = decoding & (c[:, SCHEDULED] < c[:, MAX_NEW])  # [N] not every token it may get is on its way
        every = len(running) <= budget and bool(wants.all())  # the common step: each running request decodes
        # (``nonzero`` here and below, not np.flatnonzero: its wrapper's cost, docs/host-path.md)
        prefills = [] if every else [running[i] for i in (~decoding).nonzero()[0].tolist()]
        if self.one_row:
            committed = self._commit_rows(batch, running, budget, slots, computed, wants, every)
            if committed is not None:
                return prefills, committed
        decodes = [running[i] for i in wants.nonzero()[0].tolist()]
        return prefills, self._decode_each(batch, decodes, running, budget, preempt)

    def _commit_rows(self, batch: ScheduledBatch, running: RunningRequests, budget: int, slots: np.ndarray,
                     computed: np.ndarray, wants: np.ndarray, every: bool) -> int | None:
        """``_decode_rows``' choice committed as arrays, one token a request: the budget left, or None, having
        changed nothing, where a decode's new block would preempt (max-utilization, too few blocks free)."""
        kv, tpb, counters = self.kv, self.kv.tokens_per_block, self.book.counters
        if every:  # (a copy: the list's array shifts as the list changes, and the batch keeps these)
            slots, positions = slots.copy(), computed  # [G = N] each: the input token's position
        else:
            picked = wants.nonzero()[0][:budget]  # [G] indices into running
            slots, positions = slots[picked], computed[picked]  # [G] each
        new_block = (positions >= kv.held_blocks[slots] * tpb).nonzero()[0].tolist()  # [g] starts a block
        if not self.guaranteed and len(new_block) > kv.free_blocks:
            return None
        counters[slots, COMPUTED] = positions + 1
        counters[slots, SCHEDULED] += 1
        batch.gen_positions = positions.tolist()
        batch.gen_slots, batch.gen_position_array = slots, positions
        for i in new_block:  # (enough blocks are free: checked above, or reserved at admission)
            taken = kv.allocate(int(slots[i]), batch.gen_positions[i] + 1)
            assert taken is not None, "KV cache: a decode's block was counted free and is not"
        # (a slice copies the list in C; map over the rows next; a comprehension indexing the list subclass is
        # slowest: docs/host-path.md)
        batch.gen_requests = running[:] if every else list(map(running.__getitem__, picked.tolist()))
        return budget - len(batch.gen_requests)

    def _decode_each(self, batch: ScheduledBatch, decodes: list[Request], running: RunningRequests, budget: int,
                     preempt: Preempt) -> int:
        """``_decode_rows``' choice committed request by request, where a row may not be one token (beams take
        their width of the budget, drafts a verifying chunk) or a decode's new block may preempt a later
        admission (which then drops out here); returns the budget left."""
        kv, tpb = self.kv, self.kv.tokens_per_block
        held = kv.held_blocks
        gen_requests, gen_positions = batch.gen_requests, batch.gen_positions
        spec = self.config.speculative
        for r in decodes:
            if budget < r.width:
                if budget < 1:
                    break
                continue
            if r.slot is None or r.verifying:
                continue  # preempted earlier in this loop, or it verifies drafts already
            slot, position = r.slot, r.num_computed_tokens
            if spec is not None:
                if self._verify(r, position, budget, running, batch, preempt):
                    budget -= batch.verify[-1].length
                    continue
                if r.slot is None:  # preempted to make room for its own drafts
                    continue
            if position >= held[slot] * tpb and not self._allocate(r, position + 1, running, batch, preempt):
                continue  # (the token starts a new block, and it was preempted for room)
            gen_requests.append(r)
            gen_positions.append(position)
            r.num_computed_tokens = position + 1
            r.pending_samples += 1
            budget -= r.width
        return budget

    def _verify(self, r: Request, position: int, budget: int, running: list[Request], batch: ScheduledBatch,
                preempt: Preempt) -> bool:
        """Speculative decoding: schedule ``r``'s last token and its drafts as one verifying chunk, its
        k + 1 positions counted in the budget and in KV blocks before the step (False: no drafts, or no
        room; it then decodes one token as usual). Drafts never reach past max_new_tokens: k <= the tokens
        it may still generate, less the one the target always adds."""
        assert self.config.speculative is not None
        drafts = propose_drafts(r, self.config.speculative, budget)
        if not len(drafts):
            return False
        end = position + 1 + len(drafts)
        if not self._allocate(r, end, running, batch, preempt):
            return False
        batch.add_verify(r, position, drafts)
        r.num_computed_tokens = end  # rewound to what the target accepted when the outputs come back
        r.pending_samples += 1
        r.verifying = True
        return True

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

    def _allocate(self, r: Request, tokens: int, running: list[Request], batch: ScheduledBatch,
                  preempt: Preempt) -> bool:
        """KV blocks for ``r`` to hold ``tokens`` (the KV manager's ``allocate``); while it has too few, the most
        recently admitted request is preempted and it is asked again (vLLM's loop). False if that meant
        preempting ``r`` itself. ``running`` may be the caller's selection (the pipeline passes the requests not
        in flight): a victim leaves it here, or the next round would pick it again. Under guaranteed-no-evict
        the blocks were taken at admission: nothing is ever preempted (a shortfall raises)."""
        if self.guaranteed:
            self.kv.grow(r.slot, tokens)
            return True
        while self.kv.allocate(r.slot, tokens) is None:
            victim = max(running, key=lambda x: x.admitted_seq)
            preempt(victim)
            if victim in running:
                running.remove(victim)
            batch.preempted.append(victim)
            if victim is r:
                return False
        return True

    @staticmethod
    def _add(batch: ScheduledBatch, r: Request, n: int) -> int:
        # (the counters of ``r``'s progress read and written in its book's row directly, not through the
        # request's properties: a burst's admissions each pass here, docs/host-path.md)
        c, row = r.book.counters, r.row
        computed, target = c.item(row, COMPUTED), c.item(row, TARGET)
        if computed < target:
            samples = computed + n == target
            batch.context.append(ContextChunk(r, computed, n, samples))
        else:
            samples = True
            batch.add_generation(r, computed)
        c[row, COMPUTED] = computed + n
        if samples:  # one more sample on its way: ``pending_samples`` + 1
            c[row, SCHEDULED] += 1
        return n
