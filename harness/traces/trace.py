"""A request trace: what arrives when, with how many tokens in and out."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from harness.traces.stage_drain import StageDrain


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds since the trace start
    input_tokens: int
    output_tokens: int
    request_id: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # None: built from prefix blocks and/or random (seeded)
    sampling: dict | None = None  # per-request sampling overrides (slotbench JSONL)
    # Shared-prefix blocks (Mooncake hash_ids, synthetic prefixes): the prompt opens with the tokens of
    # these blocks, each ``prefix_block_len`` long, cut to input_tokens; random tokens fill any rest.
    prefix_ids: tuple[int, ...] | None = None
    prefix_block_len: int = 0
    # Encoder–decoder models: the encoder's input length and, when given, its token ids (else seeded
    # random); input_tokens / prompt_token_ids are then the decoder's prompt.
    encoder_tokens: int = 0
    encoder_prompt_token_ids: tuple[int, ...] | None = None
    # Multi-turn sessions: turn k > 0 is sent delay_s after turn k - 1's last token, its prompt the
    # session's history followed by its own tokens (input_tokens counts its own); its arrival_s is its
    # session's first arrival, a placeholder that keeps a session's turns together through sorting and
    # fitting. harness/traces/sessions.py checks a trace's sessions.
    session_id: str | None = None
    turn: int = 0
    delay_s: float = 0.0
    stage: int = 0  # the load stage it was sent in (a workload config's stages, harness/traces/workload.py)


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    source: str  # "synthetic" or the file path
    format: str
    sha256: str | None = None
    skipped: int = 0  # rows the format defines as failed requests (BurstGPT: zero response tokens)
    notes: tuple[str, ...] = field(default=())  # things the loader fixed and says once (e.g. "sorted")
    stages: tuple[tuple[float, float, float], ...] = ()  # a workload's load stages: (start s, end s, rate req/s)
    request_timeout_s: float | None = None  # a load generator's client time-out (harness/source.py), if it has one
    max_concurrency: int | None = None  # a load generator's cap on requests in flight, if it has one
    stage_drain: StageDrain | None = None  # a load generator's rule between its stages (harness/source.py), if any

    def __len__(self) -> int:
        return len(self.requests)

    def with_requests(self, requests: list[TraceRequest], note: str | None = None) -> Trace:
        return replace(self, requests=tuple(requests), notes=self.notes + ((note,) if note else ()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arr = np.array([r.arrival_s for r in self.requests], dtype=np.float64)
        inp = np.array([r.input_tokens for r in self.requests], dtype=np.int64)
        out = np.array([r.output_tokens for r in self.requests], dtype=np.int64)
        return arr, inp, out
