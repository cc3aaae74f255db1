"""What a scheduler hands the engine for one iteration."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from strategies.runtime.request import Request


@dataclass(slots=True)
class ContextChunk:
    request: Request
    start: int  # position of the chunk's first token (> 0 for a later chunk of a chunked prefill)
    length: int  # real tokens computed in this chunk
    samples: bool  # the prefill's last chunk: the next token is sampled from its last row
    padding: int = 0  # pad tokens computed after the real ones (static batching pads to the longest)


@dataclass(slots=True)
class GenerationStep:
    request: Request  # computed as request.width rows, one per beam, all at the same position
    position: int  # position of the input token (the last sampled one, read from decoder state)


@dataclass(slots=True)
class VerifyStep:
    """Speculative decoding: a generating request's last token and its drafts, computed as one chunk."""

    request: Request
    position: int  # position of the last sampled token (the chunk's first)
    drafts: np.ndarray  # int64 [k], 1 <= k <= K: proposed tokens for positions position + 1 ...

    @property
    def length(self) -> int:
        return 1 + len(self.drafts)


@dataclass(frozen=True, slots=True)
class BatchWork:
    """What a forward computes, in the units a cost model needs (padding included: it is real work)."""

    tokens: int  # tokens through the linear layers
    samples: int  # rows through the LM head and the sampler
    kv_read_tokens: int  # KV entries attention reads: each chunk's and row's whole context
    attention_pairs: int  # (query, key) pairs attention scores, causal masking included
    # The context (prefill) chunks' share of the three above: prefill attention is compute-bound and
    # decode attention memory-bound, so a cost model prices them apart.
    context_tokens: int = 0
    context_kv_read_tokens: int = 0
    context_attention_pairs: int = 0
    context_chunks: int = 0  # prefill attention runs thread blocks per chunk (0 with context tokens: one)
    # each context chunk's (queries, keys): its tokens and its context's end (cached tokens plus itself), as
    # varlen prefill attention runs them; () where only the totals above are known (equal chunks assumed)
    context_chunk_shapes: tuple[tuple[int, int], ...] = ()
    # Encoder–decoder models: the encode piece's tokens and (non-causal) pairs; the cross-attention KV the
    # decoder's tokens read (a chunk reads its request's encoder output once, a row too) and their pairs.
    encoder_tokens: int = 0
    encoder_attention_pairs: int = 0
    cross_kv_read_tokens: int = 0
    cross_attention_pairs: int = 0


@dataclass(slots=True)
class ScheduledBatch:
    iteration: int
    context: list[ContextChunk] = field(default_factory=list)  # forward order: context first...
    # ...then one token per generating request (its beams' rows), as parallel lists rather than a
    # ``GenerationStep`` each: a decode step of ~250 requests made 250 objects per iteration, ~15% of the
    # host's time (``generation`` builds them on demand for readers off the hot path)
    gen_requests: list[Request] = field(default_factory=list)
    gen_positions: list[int] = field(default_factory=list)  # position of each one's input token
    # [G] the slot of each, where the scheduler picked them over the slots' arrays (None: read from requests)
    gen_slots: np.ndarray | None = None
    # [G] ``gen_positions`` as the array the scheduler computed them in, with ``gen_slots`` (the buffers' fill
    # reads it instead of converting the list back: docs/host-path.md)
    gen_position_array: np.ndarray | None = None
    admitted: list[Request] = field(default_factory=list)  # decoder-state rows to reset before the step
    preempted: list[Request] = field(default_factory=list)  # gave up slot and KV in this schedule
    # Speculative decoding: generating requests that verify drafts this step, computed after the context
    # chunks as chunks of their own (their outputs follow every other request's)
    verify: list[VerifyStep] = field(default_factory=list)  # append with ``add_verify``
    num_verify_tokens: int = 0  # their tokens: last ones and drafts
    # The host KV tier's copies, made before the forward (``BlockManager.take_copies``): (GPU, host) blocks out,
    # then (host, GPU) blocks in
    kv_offload: list[tuple[int, int]] = field(default_factory=list)
    kv_onload: list[tuple[int, int]] = field(default_factory=list)
    # (generation rows, of which beam rows): counted once, on first use after scheduling — the step is
    # read several times per iteration, and at batch ~200 each pass costs the simulator ~1%
    _rows: tuple[int, int] | None = None

    def add_generation(self, r: Request, position: int) -> None:
        self.gen_slots = self.gen_position_array = None
        self.gen_requests.append(r)
        self.gen_positions.append(position)

    def add_verify(self, r: Request, position: int, drafts: np.ndarray) -> None:
        self.verify.append(VerifyStep(r, position, drafts))
        self.num_verify_tokens += self.verify[-1].length

    @property
    def generation(self) -> list[GenerationStep]:
        """The generation requests as steps (a new list each call: append with ``add_generation``)."""
        return [GenerationStep(r, p) for r, p in zip(self.gen_requests, self.gen_positions, strict=True)]

    @property
    def num_context_tokens(self) -> int:
        return sum(c.length + c.padding for c in self.context)

    def no_beams(self) -> None:
        """Known to the scheduler: every request here is one row (its executor has no beam search)."""
        self._rows = (len(self.gen_requests), 0)

    def _row_counts(self) -> tuple[int, int]:
        if self._rows is None:
            rows = beam = 0
            for r in self.gen_requests:
                w = r.width
                rows += w
                if w > 1:
                    beam += w
            self._rows = (rows, beam)
        return self._rows

    @property
    def num_generation_rows(self) -> int:
        """Generation tokens: one per beam of each generating request."""
        return self._row_counts()[0]

    @property
    def num_beam_rows(self) -> int:
        """Generation rows that belong to beam-search requests."""
        return self._row_counts()[1]

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + self.num_verify_tokens + self.num_generation_rows

    @property
    def num_padding_tokens(self) -> int:
        """Pad tokens known when scheduling; rows of finished requests are counted when their output
        comes back discarded (``Strategy.postprocess``)."""
        return sum(c.padding for c in self.context)

    @property
    def sampled_requests(self) -> list[Request]:
        """Requests in the order of the step's outputs: single-row requests first, then beam requests
        grouped by width (each width is one beam-search call over adjacent rows)."""
        reqs = [c.request for c in self.context if c.samples] + self.gen_requests
        if self.num_beam_rows or any(c.request.width > 1 for c in self.context if c.samples):
            reqs = [r for r in reqs if r.width == 1] + sorted((r for r in reqs if r.width > 1), key=lambda r: r.width)
        return reqs

    def work(self) -> BatchWork:
        kv = pairs = 0
        shapes = []
        for c in self.context:
            n, end = c.length + c.padding, c.start + c.length + c.padding
            kv += end
            pairs += n * c.start + n * (n + 1) // 2
            shapes.append((n, end))
        ctx_kv, ctx_pairs = kv, pairs
        rows, beam = self._row_counts()
        if beam:
            for r, p in zip(self.gen_requests, self.gen_positions, strict=True):  # each beam row reads its
                kv += r.width * (p + 1)  # whole (indirected) context
                pairs += r.width * (p + 1)
        else:  # one row a request: its context is its position + 1
            read = sum(self.gen_positions) + len(self.gen_positions)
            kv += read
            pairs += read
        samples = sum(c.request.width for c in self.context if c.samples) + rows
        # Verification: k + 1 queries read the row's context once (memory-bound, as a decode row: the
        # generation share, not the context chunks'); every query samples.
        for v in self.verify:
            n, end = v.length, v.position + v.length
            kv += end
            pairs += n * v.position + n * (n + 1) // 2
            samples += n
        work = BatchWork(self.num_tokens, samples, kv, pairs, self.num_context_tokens, ctx_kv,
                         ctx_pairs, len(self.context), tuple(shapes))
        first = self.context[0].request if self.context else (self.gen_requests[0] if self.gen_requests else None)
        return self._encoder_work(work) if first is not None and first.encoder_len else work

    def _encoder_work(self, work: BatchWork) -> BatchWork:
        enc = [r.encoder_len for r in self.admitted]
        cross = pairs = 0
        for c in self.context:
            e = c.request.encoder_len
            cross += e
            pairs += (c.length + c.padding) * e
        for r in self.gen_requests:
            e = r.encoder_len
            cross += e
            pairs += e
        return replace(work, encoder_tokens=sum(enc), encoder_attention_pairs=sum(e * e for e in enc),
                       cross_kv_read_tokens=cross, cross_attention_pairs=pairs)

    def __bool__(self) -> bool:
        return bool(self.context or self.gen_requests or self.verify)
