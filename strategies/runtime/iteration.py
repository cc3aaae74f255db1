"""What one iteration records. Every strategy emits exactly these rows; all times are run-clock seconds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from strategies.runtime.batch import BatchWork, ScheduledBatch

NAN = float("nan")


@dataclass(slots=True)
class IterationRecord:
    iteration: int
    worker: str = ""  # fleets (disagg, replicas): the worker that ran the step (prefill0, decode1, ...), own numbering
    # Host phases of this iteration's step (under overlap, postprocess runs during the next step).
    schedule_start_s: float = NAN
    schedule_end_s: float = NAN
    prepare_start_s: float = NAN
    prepare_end_s: float = NAN
    postprocess_start_s: float = NAN
    postprocess_end_s: float = NAN
    # Device phases, as the device stream timed them (encode: encoder–decoder models, steps that admit;
    # kv_host_copy: the host KV tier's offloads and onloads, steps that move blocks).
    kv_host_copy_start_s: float = NAN
    kv_host_copy_end_s: float = NAN
    encode_start_s: float = NAN
    encode_end_s: float = NAN
    # Speculation with a draft model: its k passes before the step (another engine, waited for by the host)
    draft_start_s: float = NAN
    draft_end_s: float = NAN
    # The buffer set the step was prepared in and read back from (overlap alternates two; the pipeline
    # has one per micro-batch; -1: a peer engine without buffer sets)
    buffer_set: int = -1
    # Pipeline parallelism: this step's micro-batch (its buffer set), and each stage's compute
    micro_batch: int = -1
    stage_start_s: tuple[float, ...] = ()
    stage_end_s: tuple[float, ...] = ()
    forward_start_s: float = NAN
    forward_end_s: float = NAN
    sample_start_s: float = NAN
    sample_end_s: float = NAN
    launch_s: float = NAN  # when the host handed the step to the device stream
    wait_s: float = 0.0  # seconds the host blocked waiting for this step's outputs
    waited_before_next_launch: int = 0  # 1 if the host blocked on this step before launching the next
    # What was computed.
    num_context_requests: int = 0  # context chunks (prefill) in the forward
    # generation rows (one per beam of a beam request; a verifying request is one, spec_drafts of them), padding
    # included
    num_generation_requests: int = 0
    num_beam_rows: int = 0  # those of them that belong to beam-search requests (K per request)
    num_tokens: int = 0  # tokens computed, padding included
    num_padding_tokens: int = 0  # computed for nothing: pad tokens, rows of requests already finished
    num_samples: int = 0  # rows sampled (logit rows: one per beam of a beam request), before discards
    kv_read_tokens: int = 0  # KV entries attention reads (each request's whole context)
    attention_pairs: int = 0  # (query, key) pairs scored by attention
    num_encoder_tokens: int = 0  # encoder input tokens run by this step's encode piece
    num_context_tokens: int = 0  # tokens of context chunks (padding included); the rest are generation rows
    context_kv_read_tokens: int = 0  # the context chunks' share of kv_read_tokens
    context_attention_pairs: int = 0  # the context chunks' share of attention_pairs
    # Executor state when the step was scheduled.
    active_slots: int = 0
    waiting_requests: int = 0
    kv_blocks_used: int = 0  # blocks held by running requests
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # cached blocks nobody holds: free, but reusable by a prefix hit
    kv_evictions: int = 0  # cached blocks wiped by this iteration's allocations
    # The host KV tier (--kv-offload-blocks): its blocks holding keys, its size, and the blocks this step copies
    # out to it (evicted from the pool) and back in from it (prefix hits it held)
    host_kv_blocks_used: int = 0
    host_kv_blocks_total: int = 0
    kv_offloaded_blocks: int = 0
    kv_onloaded_blocks: int = 0
    kv_offloaded_bytes: int = 0  # those blocks' bytes (the model's, every layer and KV head)
    kv_onloaded_bytes: int = 0
    preemptions: int = 0  # requests preempted by this iteration's schedule
    # Speculative decoding (vLLM's counters): verifying requests whose outcome was read (each proposed >= 1
    # draft; one preempted with its step in flight received nothing and is not counted), their draft
    # tokens, the drafts requests received (the target agreed, before a stop or the length limit), and
    # of those, how many at each draft position (0-based).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: tuple[int, ...] = ()

    def count_batch(self, batch: ScheduledBatch) -> None:
        """What the schedule put in the step."""
        self.num_context_requests = len(batch.context)
        self.num_generation_requests = batch.num_generation_rows + len(batch.verify)
        self.num_beam_rows = batch.num_beam_rows
        self.num_tokens = batch.num_tokens
        self.num_padding_tokens = batch.num_padding_tokens

    def count_work(self, w: BatchWork) -> None:
        """What the forward computes, as the cost model sees it."""
        self.kv_read_tokens, self.attention_pairs = w.kv_read_tokens, w.attention_pairs
        self.num_context_tokens = w.context_tokens
        self.context_kv_read_tokens, self.context_attention_pairs = w.context_kv_read_tokens, w.context_attention_pairs

    def to_dict(self) -> dict:
        return asdict(self)


ITERATION_COLUMNS = [f.name for f in fields(IterationRecord)]


def take_done(records: list[IterationRecord]) -> list[IterationRecord]:
    """The leading records of ``records`` whose steps are done (postprocessed) and no longer change, taken out of the
    list in place (it may be a recorder's) — what a long-running server writes away as it goes. Never the newest:
    the next launch still writes its ``waited_before_next_launch``."""
    n = 0
    while n < len(records) - 1 and records[n].postprocess_end_s == records[n].postprocess_end_s:  # (not NaN)
        n += 1
    out = records[:n]
    del records[:n]
    return out
