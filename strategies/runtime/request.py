"""A request and its progress. One book holds its counters, tokens and token times, in one row: the runtime's
per-slot arrays while it holds a slot (``progress.py``), a one-row book of its own otherwise — every read and
write goes to ``book[row]``, whichever it is; strategies keep no parallel bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from strategies.runtime.progress import COMPUTED, MAX_NEW, OUTPUTS, PROMPT, SCHEDULED, TARGET, Booked, SlotProgress
from strategies.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # visible to the executor, holds no slot
    RUNNING = "running"  # holds a slot and KV blocks
    FINISHED = "finished"
    REJECTED = "rejected"  # never admitted: it can not fit this executor's limits
    FAILED = "failed"  # the run stopped (fault or interrupt) before it finished

    terminal: bool  # set on each member below: read once per sampled token, so a plain attribute


for _status in Status:
    _status.terminal = _status in (Status.FINISHED, Status.REJECTED, Status.FAILED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: np.ndarray | None  # int64 [prompt_len]; None: never built (too long to serve)
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0  # when the client sent it, seconds since run start
    num_prompt_tokens: int | None = None  # the claimed prompt length when prompt_token_ids is None
    # Encoder–decoder models: the encoder's input (int64 [encoder_len]); the prompt is then the decoder's
    encoder_prompt_token_ids: np.ndarray | None = None
    # Multi-turn sessions (the client's, harness/source.py): the session, this request's turn in it, and
    # the think time after the previous turn's last token before this turn is sent. A later turn's
    # prompt gains the session's history when it is sent (``prepend_history``).
    session_id: str | None = None
    turn: int = 0
    turn_delay_s: float = 0.0
    stage: int = 0  # the load stage the client sent it in (a workload's stages; 0 without them)

    status: Status = Status.WAITING
    slot: int | None = None
    last_slot: int | None = None  # the slot it held last (kept after release, for the records)
    verifying: bool = False  # a verifying step is in flight: its next position is known once it is read
    draft_computed: int = 0  # speculation with a draft model: tokens whose keys the draft engine holds
    finish_reason: str | None = None  # "stop", "length", or why it was rejected / failed
    preemptions: int = 0
    admitted_seq: int = -1  # admission order: max-utilization preempts the most recent first
    admitted_s: float | None = None  # first admission (run clock): where its wait in the queue ended
    failed_s: float | None = None  # when a failure ended it (run clock); None: it did not fail
    # Disaggregated serving (run clock): the prefill worker's first token (``first_token_to_client``), its KV ready
    # to leave (the handoff), the transfer's start and landing, and the bytes moved (whole blocks)
    prefill_first_token_s: float | None = None
    kv_ready_s: float | None = None
    kv_transfer_start_s: float | None = None
    kv_transfer_end_s: float | None = None
    kv_transfer_bytes: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache at first admission, not computed
    host_cached_tokens: int = 0  # of those, the ones the host KV tier held (onloaded, not computed)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks (block manager)
    # Beam search's answer, best first: (generated tokens, length-penalised score) of each returned
    # sequence; set when the request finishes. Until then a beam request's token buffer holds beam 0's
    # token of each step, which later steps may reorder away: only the counts mean anything.
    beams: list[tuple[list[int], float]] | None = None
    # Progress, read and written through the properties below in ``book``'s row ``row``: the runtime's per-slot
    # book and the slot's row while the request holds a slot (progress.py), its own one-row book (``own``) and
    # row 0 otherwise.
    book: SlotProgress = field(init=False, repr=False)
    row: int = field(default=0, init=False, repr=False)
    own: SlotProgress = field(init=False, repr=False)

    num_computed_tokens = Booked(COMPUTED)  # tokens whose KV is written or launched (slot's cache)
    context_target = Booked(TARGET)  # tokens to prefill on this admission: prompt + outputs known then

    @property
    def pending_samples(self) -> int:
        """Samples launched on the device whose token the host has not read yet."""
        c, row = self.book.counters, self.row
        return c.item(row, SCHEDULED) - c.item(row, OUTPUTS)

    @pending_samples.setter
    def pending_samples(self, value: int) -> None:
        c, row = self.book.counters, self.row
        c[row, SCHEDULED] = c.item(row, OUTPUTS) + value

    @property
    def num_output_tokens(self) -> int:  # output tokens the host has received
        return self.book.counters.item(self.row, OUTPUTS)

    @num_output_tokens.setter
    def num_output_tokens(self, value: int) -> None:
        c, row = self.book.counters, self.row
        c[row, SCHEDULED] += value - c.item(row, OUTPUTS)  # as many samples still in flight as before
        c[row, OUTPUTS] = value

    # Plain attributes fixed at creation, because the scheduler reads them per request per step:
    width: int = field(init=False)  # decoder rows the request occupies: its beams (1 without beam search)
    prompt_len: int = field(init=False)  # prompt tokens (the claimed count when never built)
    encoder_len: int = field(init=False)  # encoder input tokens (0 for a decoder-only model)

    def __post_init__(self) -> None:
        self.width = self.sampling.beam_width
        enc = self.encoder_prompt_token_ids
        self.encoder_len = 0 if enc is None else len(enc)
        if self.prompt_token_ids is None:  # sized from the claim, allocated nothing: it is only rejected
            self.prompt_len = int(self.num_prompt_tokens or 0)
            self._own_book(np.zeros(0, dtype=np.int64), built=False)
            return
        self._own_book(np.asarray(self.prompt_token_ids, dtype=np.int64))

    def _own_book(self, prompt: np.ndarray, built: bool = True) -> None:
        """A book of its own for the progress while it holds no slot: one row for prompt and outputs, so a resume
        after preemption prefills a plain slice. ``built``: the prompt is there (else only its length is)."""
        new = max(self.max_new_tokens, 0)
        self.own = SlotProgress(1, len(prompt) + new if built else 0, new if built else 0)
        self.own.tokens[0, :len(prompt)] = prompt
        self.prompt_token_ids = self.own.tokens[0, :len(prompt)]
        if built:
            self.prompt_len = len(prompt)
        self.own.counters[0, MAX_NEW], self.own.counters[0, PROMPT] = new, self.prompt_len
        self.book, self.row = self.own, 0

    def prepend_history(self, history: np.ndarray) -> None:
        """Open the prompt with ``history`` (a session's earlier turns); only before it is sent (a new book)."""
        assert self.status is Status.WAITING and self.admitted_seq < 0 and not self.block_hashes
        if not self.own.tokens.shape[1]:  # never built (too long to serve): only the claimed length grows
            self.prompt_len += len(history)
            self.num_prompt_tokens = self.own.counters[0, PROMPT] = self.prompt_len
            return
        self._own_book(np.concatenate([np.asarray(history, dtype=np.int64), self.prompt_token_ids]))

    @property
    def token_ids(self) -> np.ndarray:
        """Prompt followed by the outputs the host has received."""
        book, row = self.book, self.row
        return book.tokens[row, : self.prompt_len + book.counters.item(row, OUTPUTS)]

    @property
    def output_tokens(self) -> np.ndarray:
        """[n] the generated tokens (for beam search the best returned sequence), as an array: a view of the
        progress where there is no beam search (read it before the request takes more tokens)."""
        if self.beams:
            return np.asarray(self.beams[0][0], dtype=np.int64)
        return self.token_ids[self.prompt_len:]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens; for beam search the best returned sequence."""
        return self.output_tokens.tolist()

    @property
    def token_times_s(self) -> list[float]:
        """When the host handed each output token out (run clock)."""
        return self.token_times_since(0)

    def token_times_since(self, start: int) -> list[float]:
        """``token_times_s[start:]``, reading none of the times before ``start``: a server's front end reads each
        step's new ones, and a read of all of them each step made a request's streaming quadratic in its length."""
        book, row = self.book, self.row
        return book.times[row, start: book.counters.item(row, OUTPUTS)].tolist()

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.context_target

    @property
    def num_scheduled_samples(self) -> int:
        return self.book.counters.item(self.row, SCHEDULED)

    @property
    def wants_more_samples(self) -> bool:
        """False once every token up to max_new_tokens is received or already on its way."""
        return self.num_scheduled_samples < self.max_new_tokens

    @property
    def first_token_s(self) -> float | None:
        # (one element: not the whole list of times, read per request when written)
        return self.book.times.item(self.row, 0) if self.num_output_tokens else None

    @property
    def finish_s(self) -> float | None:
        if self.status is not Status.FINISHED:
            return None
        n = self.num_output_tokens
        return self.book.times.item(self.row, n - 1) if n else None

    def first_token_to_client(self, at_s: float) -> None:
        """Disagg: the first token reaches a client behind a proxy at ``at_s`` (the prefill's time is kept)."""
        times = self.book.times[self.row]
        self.prefill_first_token_s, times[0] = float(times[0]), at_s

    def append_token(self, token: int, now_s: float) -> None:
        book, row = self.book, self.row
        n = book.counters.item(row, OUTPUTS)
        book.tokens[row, self.prompt_len + n] = token
        book.times[row, n] = now_s
        book.counters[row, SCHEDULED:OUTPUTS + 1] += 1  # received, and scheduled: as many still in flight

    def admit(self, slot: int, seq: int, cached_tokens: int = 0, now_s: float | None = None,
              book: SlotProgress | None = None) -> None:
        """Take ``slot`` at ``now_s``, ``cached_tokens`` keys in cached blocks; ``book``: progress in its row."""
        if self.admitted_seq < 0:
            self.cached_tokens = min(cached_tokens, self.prompt_len)
            self.admitted_s = now_s
        self.status = Status.RUNNING
        self.slot = self.last_slot = slot
        self.admitted_seq = seq
        if book is None:
            self.num_computed_tokens = cached_tokens
            self.context_target = self.prompt_len + self.num_output_tokens
        else:
            self._into(book, slot, cached_tokens)

    @property
    def in_slot_book(self) -> bool:
        """Its progress is in the runtime's per-slot book (it holds a slot there), not in its own."""
        return self.book is not self.own

    def leave_slot(self) -> None:
        """Let the slot go: the progress comes back from the slot's book into the request's own."""
        if self.book is not self.own:
            self._out_of(self.book, self.slot)
        self.slot = None

    def _into(self, book: SlotProgress, slot: int, computed: int) -> None:
        """Move the progress into ``slot``'s row of ``book``, ``computed`` tokens computed and the prompt and the
        outputs so far to prefill. The two counters are set on the way in, not in its own row first: that row is
        not read again until the progress comes back (``_out_of``), which overwrites it."""
        assert self.book is self.own, f"{self.request_id} is admitted while it holds slot {self.slot}"
        own = self.own
        c = own.counters[0].tolist()
        outputs = c[OUTPUTS]
        c[COMPUTED], c[TARGET] = computed, self.prompt_len + outputs
        book.take(slot, self, c, own.tokens[0, :self.prompt_len + outputs], own.times[0, :outputs],
                  self.status is Status.RUNNING)
        self.book, self.row = book, slot

    def _out_of(self, book: SlotProgress, slot: int) -> None:
        """Take the progress back from ``slot``'s row of ``book``."""
        assert book.holder[slot] is self
        c, outputs, times = book.give_back(slot)
        own, n = self.own, len(outputs)
        own.counters[0] = c
        own.tokens[0, self.prompt_len:self.prompt_len + n] = outputs
        own.times[0, :n] = times
        self.book, self.row = own, 0

    def preempt(self) -> None:
        """Drop the slot and the KV; the prompt and the outputs so far are recomputed on resume. A beam request
        starts over: its beams lived only in the decoder state it gave up (the search is deterministic)."""
        self.leave_slot()
        self.status = Status.WAITING
        self.num_computed_tokens = self.draft_computed = 0
        self.preemptions += 1
        if self.width > 1:
            self.num_output_tokens = 0

    def end(self, status: Status, reason: str, at_s: float | None = None) -> None:
        """Terminal status; the strategy releases the slot (static keeps it until its batch ends). ``at_s``: when a
        failure ended it (run clock; a finished request ends at its last token, a rejected one at its arrival)."""
        self.status = status
        self.finish_reason = reason
        if status is Status.FAILED:
            self.failed_s = at_s
        if self.book is not self.own:  # static keeps a finished request's slot: no longer running in it
            self.book.key[self.slot] &= ~1
