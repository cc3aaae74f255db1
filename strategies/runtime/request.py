"""A request and its progress. One book holds its counters and tokens: the runtime's per-slot arrays while it
holds a slot (``progress.py``), the request itself otherwise; strategies keep no parallel bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.progress import COMPUTED, OUTPUTS, SCHEDULED, TARGET, Booked
from strategies.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from strategies.runtime.progress import SlotProgress


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
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks (block manager)
    # Beam search's answer, best first: (generated tokens, length-penalised score) of each returned
    # sequence; set when the request finishes. Until then a beam request's token buffer holds beam 0's
    # token of each step, which later steps may reorder away: only the counts mean anything.
    beams: list[tuple[list[int], float]] | None = None
    # Progress, read and written through the properties below: while the request holds a slot it lives in
    # the runtime's per-slot book (``book``, progress.py), otherwise in these fields.
    _computed: int = field(default=0, init=False, repr=False)
    _target: int = field(default=0, init=False, repr=False)
    _pending: int = field(default=0, init=False, repr=False)
    _outputs: int = field(default=0, init=False, repr=False)
    _times: list[float] = field(default_factory=list, init=False, repr=False)
    book: SlotProgress | None = field(default=None, init=False, repr=False)

    num_computed_tokens = Booked(COMPUTED, "_computed")  # tokens whose KV is written or launched (slot's cache)
    context_target = Booked(TARGET, "_target")  # tokens to prefill on this admission: prompt + outputs known then

    @property
    def pending_samples(self) -> int:
        """Samples launched on the device whose token the host has not read yet."""
        book = self.book
        if book is None:
            return self._pending
        return book.counters.item(self.slot, SCHEDULED) - book.counters.item(self.slot, OUTPUTS)

    @pending_samples.setter
    def pending_samples(self, value: int) -> None:
        book = self.book
        if book is None:
            self._pending = value
        else:
            book.counters[self.slot, SCHEDULED] = book.counters.item(self.slot, OUTPUTS) + value

    @property
    def num_output_tokens(self) -> int:  # output tokens the host has received
        book = self.book
        return self._outputs if book is None else book.counters.item(self.slot, OUTPUTS)

    @num_output_tokens.setter
    def num_output_tokens(self, value: int) -> None:
        book = self.book
        if book is None:
            self._outputs = value
        else:  # as many samples still in flight as before
            book.counters[self.slot, SCHEDULED] += value - book.counters.item(self.slot, OUTPUTS)
            book.counters[self.slot, OUTPUTS] = value

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
            self._tokens = np.zeros(0, dtype=np.int64)
            self.prompt_token_ids = self._tokens
            return
        prompt = np.asarray(self.prompt_token_ids, dtype=np.int64)
        # One buffer for prompt and outputs, so a resume after preemption prefills a plain slice.
        self._tokens = np.zeros(len(prompt) + max(self.max_new_tokens, 0), dtype=np.int64)
        self._tokens[: len(prompt)] = prompt
        self.prompt_token_ids = self._tokens[: len(prompt)]
        self.prompt_len = len(prompt)

    def prepend_history(self, history: np.ndarray) -> None:
        """Open the prompt with ``history`` (a session's earlier turns); only before it is sent (a new buffer)."""
        assert self.status is Status.WAITING and self.admitted_seq < 0 and not self.block_hashes
        if not len(self._tokens):  # never built (too long to serve): only the claimed length grows
            self.prompt_len += len(history)
            self.num_prompt_tokens = self.prompt_len
            return
        own = self.prompt_token_ids
        self._tokens = np.zeros(len(history) + len(own) + max(self.max_new_tokens, 0), dtype=np.int64)
        self._tokens[: len(history)] = history
        self._tokens[len(history): len(history) + len(own)] = own
        self.prompt_len = len(history) + len(own)
        self.prompt_token_ids = self._tokens[: self.prompt_len]

    @property
    def token_ids(self) -> np.ndarray:
        """Prompt followed by the outputs the host has received."""
        book = self.book
        if book is None:
            return self._tokens[: self.prompt_len + self._outputs]
        return book.tokens[self.slot, : self.prompt_len + book.counters.item(self.slot, OUTPUTS)]

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
        book = self.book
        if book is None:
            return self._times[start:]
        return book.times[self.slot, start: book.counters.item(self.slot, OUTPUTS)].tolist()

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.context_target

    @property
    def num_scheduled_samples(self) -> int:
        book = self.book
        return self._outputs + self._pending if book is None else book.counters.item(self.slot, SCHEDULED)

    @property
    def wants_more_samples(self) -> bool:
        """False once every token up to max_new_tokens is received or already on its way."""
        return self.num_scheduled_samples < self.max_new_tokens

    @property
    def first_token_s(self) -> float | None:
        times = self.token_times_s
        return times[0] if times else None

    @property
    def finish_s(self) -> float | None:
        times = self.token_times_s
        return times[-1] if self.status is Status.FINISHED and times else None

    def first_token_to_client(self, at_s: float) -> None:
        """Disagg: the first token reaches a client behind a proxy at ``at_s`` (the prefill's time is kept)."""
        book = self.book
        times = self._times if book is None else book.times[self.slot]
        self.prefill_first_token_s, times[0] = float(times[0]), at_s

    def append_token(self, token: int, now_s: float) -> None:
        book = self.book
        if book is None:
            self._tokens[self.prompt_len + self._outputs] = token
            self._outputs += 1
            self._times.append(now_s)
            return
        slot = self.slot
        n = book.counters.item(slot, OUTPUTS)
        book.tokens[slot, self.prompt_len + n] = token
        book.times[slot, n] = now_s
        book.counters[slot, SCHEDULED:OUTPUTS + 1] += 1  # received, and scheduled: as many still in flight

    def admit(self, slot: int, seq: int, cached_tokens: int = 0, now_s: float | None = None,
              book: SlotProgress | None = None) -> None:
        """Take ``slot`` at ``now_s``, ``cached_tokens`` keys in cached blocks; ``book``: progress in its row."""
        if self.admitted_seq < 0:
            self.cached_tokens = min(cached_tokens, self.prompt_len)
            self.admitted_s = now_s
        self.status = Status.RUNNING
        self.slot = self.last_slot = slot
        self.admitted_seq = seq
        self._computed = cached_tokens
        self._target = self.prompt_len + self._outputs
        if book is not None:
            self._into(book, slot)

    def leave_slot(self) -> None:
        """Let the slot go: the progress comes back from the slot's book onto the request."""
        if self.book is not None:
            self._out_of(self.book, self.slot)
        self.slot = None

    def _into(self, book: SlotProgress, slot: int) -> None:
        """Move the progress into ``slot``'s row of ``book``."""
        n = self.prompt_len + self._outputs
        book.take(slot, self, (self._computed, self._target, self._outputs + self._pending, self._outputs,
                               self.max_new_tokens, self.prompt_len), self._tokens[:n], self._times,
                  self.status is Status.RUNNING)
        self.book = book

    def _out_of(self, book: SlotProgress, slot: int) -> None:
        """Take the progress back from ``slot``'s row of ``book``."""
        assert book.holder[slot] is self
        c, outputs, self._times = book.give_back(slot)
        self._tokens[self.prompt_len:self.prompt_len + len(outputs)] = outputs
        self._computed, self._target = c[COMPUTED], c[TARGET]
        self._pending, self._outputs = c[SCHEDULED] - c[OUTPUTS], c[OUTPUTS]
        self.book = None

    def preempt(self) -> None:
        """Drop the slot and the KV; the prompt and the outputs so far are recomputed on resume. A beam request
        starts over: its beams lived only in the decoder state it gave up (the search is deterministic)."""
        self.leave_slot()
        self.status = Status.WAITING
        self._computed = self.draft_computed = 0
        self.preemptions += 1
        if self.width > 1:
            self._outputs = 0
            self._times.clear()

    def end(self, status: Status, reason: str, at_s: float | None = None) -> None:
        """Terminal status; the strategy releases the slot (static keeps it until its batch ends). ``at_s``: when a
        failure ended it (run clock; a finished request ends at its last token, a rejected one at its arrival)."""
        self.status = status
        self.finish_reason = reason
        if status is Status.FAILED:
            self.failed_s = at_s
        if self.book is not None:  # static keeps a finished request's slot: no longer running in it
            self.book.key[self.slot] &= ~1
