"""What a scheduler hands the engine for one iteration."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    request: Request
    position: int  # position of the input token (the last sampled one, read from decoder state)


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


@dataclass(slots=True)
class ScheduledBatch:
    iteration: int
    context: list[ContextChunk] = field(default_factory=list)  # forward order: context first...
    generation: list[GenerationStep] = field(default_factory=list)  # ...then one token per request
    admitted: list[Request] = field(default_factory=list)  # decoder-state rows to reset before the step
    preempted: list[Request] = field(default_factory=list)  # gave up slot and KV in this schedule

    @property
    def num_context_tokens(self) -> int:
        return sum(c.length + c.padding for c in self.context)

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + len(self.generation)

    @property
    def num_padding_tokens(self) -> int:
        """Pad tokens known when scheduling; rows of finished requests are counted when their output
        comes back discarded (``Strategy._postprocess``)."""
        return sum(c.padding for c in self.context)

    @property
    def sampled_requests(self) -> list[Request]:
        """Requests in the order of the step's output rows."""
        return [c.request for c in self.context if c.samples] + [g.request for g in self.generation]

    def work(self) -> BatchWork:
        kv = pairs = 0
        for c in self.context:
            n, end = c.length + c.padding, c.start + c.length + c.padding
            kv += end
            pairs += n * c.start + n * (n + 1) // 2
        ctx_kv, ctx_pairs = kv, pairs
        for g in self.generation:
            kv += g.position + 1
            pairs += g.position + 1
        samples = sum(1 for c in self.context if c.samples) + len(self.generation)
        return BatchWork(self.num_tokens, samples, kv, pairs, self.num_context_tokens, ctx_kv, ctx_pairs)

    def __bool__(self) -> bool:
        return bool(self.context or self.generation)
