"""Static batching's policy: a batch is formed only when none runs, and it runs until all of it is done.

Prompts are padded to the longest in the batch and prefilled in forwards of at most ``max_num_tokens``
tokens (whole rows each; a row longer than that runs alone, whole: a padded row cannot be chunked); then
every row decodes together, and rows whose request has finished keep computing as padding until the last
one is done (as FasterTransformer and ``generate`` do). Nothing is admitted mid-batch. A row reserves the KV
its padded prompt and the batch's decode steps really write; slots and blocks go back when the batch ends
(the strategy's loop, ``static/executor.py``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from strategies.config import ExecutorConfig
from strategies.runtime.batch import ContextChunk, ScheduledBatch
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.request import Request, Status
from strategies.speculation import propose_drafts

if TYPE_CHECKING:
    from strategies.parts import Admit, Queues


class StaticBatcher:
    trims_rejected_kv = False  # a row's blocks are its reservation to the batch's end

    def __init__(self, config: ExecutorConfig, kv: BlockManager, cross_kv: BlockManager | None) -> None:
        self.config = config
        self.kv = kv
        self.cross_kv = cross_kv  # encoder–decoder models: cross-attention blocks, taken whole at admission
        self.batch: list[Request] = []  # the batch that runs, finished rows included, until all of it is done
        self._to_prefill: deque[Request] = deque()
        self._longest = 0  # the batch's padded prompt length
        self._encoder_tokens = 0  # the batch's encoder inputs, run in its first forward

    def rejection(self, r: Request) -> str | None:
        need = r.prompt_len + r.encoder_len  # the encoder input shares the first forward
        if r.encoder_len and need > self.config.max_num_tokens:
            return (f"prompt ({need} tokens, encoder input included) exceeds max_num_tokens "
                    f"({self.config.max_num_tokens}): one forward")
        return None

    @property
    def done(self) -> bool:
        """Every row of the batch has ended (and the batch's slots may go back)."""
        return all(r.status.terminal for r in self.batch)

    def schedule(self, iteration: int, queues: Queues, running: list[Request]) -> ScheduledBatch:
        """A new batch from ``queues``' waiting requests when none runs, else the running batch's next step (its
        own rows: ``running`` is not read)."""
        batch = ScheduledBatch(iteration)
        if not self.batch:
            self._form_batch(batch, queues.waiting, queues.admit)
        if self._to_prefill:
            self._prefill(batch)
        elif self.batch:
            self._decode(batch)
        return batch

    def _row_tokens(self, r: Request, longest: int, max_new: int) -> int:
        """KV a row writes: its padded prompt, then one position per decode step of the whole batch."""
        return min(self.config.max_seq_len, max(longest, r.prompt_len + max_new))

    def _form_batch(self, batch: ScheduledBatch, waiting: deque[Request], admit: Admit) -> None:
        rows: list[tuple[Request, list[int]]] = []
        longest = max_new = need = width = enc = cross = 0
        while waiting and width + waiting[0].width <= self.config.max_batch_size:  # a row per beam
            r = waiting[0]
            # Encoder inputs all run in the first forward, with at least the first padded prompt.
            if r.encoder_len and (enc + r.encoder_len + max(longest, r.prompt_len) > self.config.max_num_tokens
                                  or cross + self.cross_kv.blocks_for(r.encoder_len) > self.cross_kv.free_blocks):
                break
            hits = self.kv.prefix_hit(r)
            grown = (max(longest, r.prompt_len), max(max_new, r.max_new_tokens))
            if grown != (longest, max_new):  # every row's reservation grows with the batch's extremes
                need = sum(self.kv.admission_blocks(h, self._row_tokens(x, *grown), x) for x, h in rows)
            need += self.kv.admission_blocks(hits, self._row_tokens(r, *grown), r)
            if need > self.kv.free_blocks:
                break
            waiting.popleft()
            rows.append((r, hits))
            longest, max_new = grown
            width += r.width
            enc += r.encoder_len
            cross += self.cross_kv.blocks_for(r.encoder_len) if r.encoder_len else 0
        for r, _ in rows:
            # Hits again, now: an earlier row's admission may have evicted a cached block this row's count
            # relied on (it was free then). Each lost hit, and the chain after it, becomes a new block
            # instead: the batch's total stays within what the loop counted, as nothing else is running.
            admit(r, self.kv.prefix_hit(r), self._row_tokens(r, longest, max_new))
            batch.admitted.append(r)
        self.batch = [r for r, _ in rows]
        self._to_prefill = deque(self.batch)
        self._longest = longest
        self._encoder_tokens = enc

    def _prefill(self, batch: ScheduledBatch) -> None:
        budget = self.config.max_num_tokens - (self._encoder_tokens if batch.admitted else 0)
        while self._to_prefill:
            r = self._to_prefill[0]
            n = self._longest - r.num_computed_tokens  # from the cached prefix to the padded end
            if n > budget and batch.context:  # over the budget: alone in a step of its own
                break
            self._to_prefill.popleft()
            real = r.prompt_len - r.num_computed_tokens
            batch.context.append(ContextChunk(r, r.num_computed_tokens, real, True, padding=n - real))
            r.num_computed_tokens = r.prompt_len
            r.pending_samples += 1
            budget -= n

    def _decode(self, batch: ScheduledBatch) -> None:
        last = self.config.max_seq_len - 1
        spec = self.config.speculative
        budget = self.config.max_num_tokens - len(self.batch)  # room for drafts beside one token per row
        held, tpb = self.kv.held_blocks, self.kv.tokens_per_block
        for r in self.batch:  # finished rows too: they are computed and their output discarded
            # ...within the blocks the row holds: a row that finished early by accepting drafts would otherwise
            # step past its reservation and write, through a block-table entry it does not hold, into another
            # request's block
            position = min(r.num_computed_tokens, last, held[r.slot] * tpb - 1)
            # A running row may verify drafts instead: they stay within its reservation (prompt +
            # max_new_tokens), as propose_drafts never reaches past max_new_tokens.
            drafts = propose_drafts(r, spec, budget + 1) if spec and r.status is Status.RUNNING else ()
            if len(drafts):
                batch.add_verify(r, position, drafts)
                budget -= len(drafts)
                r.num_computed_tokens = position + 1 + len(drafts)  # rewound to what it receives
                r.verifying = True
            else:
                batch.add_generation(r, position)
                r.num_computed_tokens += 1
            r.pending_samples += 1
