"""A request and its progress. The request owns its counters; strategies keep no parallel bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Status(enum.Enum):
    WAITING = "waiting"  # visible to the executor, holds no slot
    RUNNING = "running"  # holds a slot and KV blocks
    FINISHED = "finished"
    REJECTED = "rejected"  # never admitted: it can not fit this executor's limits
    FAILED = "failed"  # the run stopped (fault or interrupt) before it finished

    terminal: bool  # set on each member below: read once per sampled token, so a plain attribute


for _status in Status:
    _status.terminal = _status in (Status.FINISHED, Status.REJECTED, Status.FAILED)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 disable a filter."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS, unless ignore_eos
    ignore_eos: bool = False
    # Beam search (deterministic, Hugging Face's meanings): beams kept per request; the exponent of the
    # generated length that divides a finished beam's log-probability; when a request stops (True: as
    # soon as beam_width beams finished; False: once no running beam can beat the finished ones by HF's
    # heuristic; "never": the exact criterion); how many of the best finished beams are returned.
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not 1 <= self.num_return_sequences <= self.beam_width:
            raise ValueError(f"num_return_sequences must be in [1, beam_width={self.beam_width}], "
                             f"got {self.num_return_sequences}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.beam_width > 1 and self.temperature > 0:
            raise ValueError("beam search is deterministic here: temperature must be 0 with beam_width > 1")

    @property
    def early_stopping_code(self) -> int:
        """The device's encoding of early_stopping: 0 False, 1 True, 2 "never"."""
        return 2 if self.early_stopping == "never" else int(bool(self.early_stopping))

    @property
    def uses_filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


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

    status: Status = Status.WAITING
    slot: int | None = None
    last_slot: int | None = None  # the slot it held last (kept after release, for the records)
    num_computed_tokens: int = 0  # tokens whose KV is written or launched into the slot's cache
    context_target: int = 0  # tokens to prefill on this admission: prompt + outputs known at admission
    pending_samples: int = 0  # samples launched on the device whose token the host has not read yet
    verifying: bool = False  # a verifying step is in flight: its next position is known once it is read
    draft_computed: int = 0  # speculation with a draft model: tokens whose keys the draft engine holds
    num_output_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)  # when the host handed each token out
    finish_reason: str | None = None  # "stop", "length", or why it was rejected / failed
    preemptions: int = 0
    admitted_seq: int = -1  # admission order: max-utilization preempts the most recent first
    admitted_s: float | None = None  # first admission (run clock): where its wait in the queue ended
    # Disaggregated serving: when the prompt's KV left the prefill worker and landed on the decode worker
    # (run clock), and the bytes moved (whole blocks)
    kv_transfer_start_s: float | None = None
    kv_transfer_end_s: float | None = None
    kv_transfer_bytes: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache at first admission, not computed
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks (block manager)
    # Beam search's answer, best first: (generated tokens, length-penalised score) of each returned
    # sequence; set when the request finishes. Until then a beam request's token buffer holds beam 0's
    # token of each step, which later steps may reorder away: only the counts mean anything.
    beams: list[tuple[list[int], float]] | None = None

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
        """Open the prompt with ``history`` (a session's earlier prompts and outputs); only before the
        request is sent, since the prompt buffer is rebuilt."""
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
        return self._tokens[: self.prompt_len + self.num_output_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens; for beam search the best returned sequence."""
        if self.beams:
            return list(self.beams[0][0])
        return self._tokens[self.prompt_len: self.prompt_len + self.num_output_tokens].tolist()

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.context_target

    @property
    def num_scheduled_samples(self) -> int:
        return self.num_output_tokens + self.pending_samples

    @property
    def wants_more_samples(self) -> bool:
        """False once every token up to max_new_tokens is received or already on its way."""
        return self.num_scheduled_samples < self.max_new_tokens

    @property
    def first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def finish_s(self) -> float | None:
        return self.token_times_s[-1] if self.status is Status.FINISHED and self.token_times_s else None

    def append_token(self, token: int, now_s: float) -> None:
        self._tokens[self.prompt_len + self.num_output_tokens] = token
        self.num_output_tokens += 1
        self.token_times_s.append(now_s)

    def admit(self, slot: int, seq: int, cached_tokens: int = 0, now_s: float | None = None) -> None:
        """Take ``slot`` at ``now_s``; the first ``cached_tokens`` tokens' keys are already in cached blocks."""
        if self.admitted_seq < 0:
            self.cached_tokens = min(cached_tokens, self.prompt_len)
            self.admitted_s = now_s
        self.status = Status.RUNNING
        self.slot = self.last_slot = slot
        self.admitted_seq = seq
        self.num_computed_tokens = cached_tokens
        self.context_target = self.prompt_len + self.num_output_tokens

    def preempt(self) -> None:
        """Drop the slot and the KV; the prompt and the outputs so far are recomputed on resume. A beam
        request starts over: its beams' histories lived only in the decoder state it gave up (the search
        is deterministic, so it ends the same; its token times are those of the final attempt)."""
        self.status = Status.WAITING
        self.slot = None
        self.num_computed_tokens = self.draft_computed = 0
        self.preemptions += 1
        if self.width > 1:
            self.num_output_tokens = 0
            self.token_times_s.clear()

    def end(self, status: Status, reason: str) -> None:
        """Terminal status; the strategy releases the slot (static keeps it until its batch ends)."""
        self.status = status
        self.finish_reason = reason
