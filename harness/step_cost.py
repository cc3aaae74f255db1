"""A step described from the command line (``slotbench step-cost``), costed as a scheduled one would be."""

from __future__ import annotations

from types import SimpleNamespace

from strategies.runtime.batch import BatchWork, ContextChunk, ScheduledBatch

_ROW = SimpleNamespace(width=1, encoder_len=0)  # stands for a request: one row, no beams, no encoder


def _ints(text: str, flag: str, parts: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(":")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= parts or min(values, default=-1) < 0 or values[0] == 0:
        form = "B:KV" if flag == "--decode" else "N[:KV]"
        raise ValueError(f"{flag} {text!r}: expected {form} with a positive count and cached tokens >= 0")
    return values


def parse_pieces(decodes: list[str], prefills: list[str]) -> BatchWork:
    """``--decode B:KV`` (B generation rows, KV cached tokens each) and ``--prefill N[:KV]`` (one N-token
    prompt chunk after KV cached tokens, its last row sampled), as the one batch they make together.
    The work is counted by ``ScheduledBatch.work``, the scheduler's own accounting."""
    batch = ScheduledBatch(0)
    for text in prefills:
        n, *kv = _ints(text, "--prefill", 2)
        batch.context.append(ContextChunk(_ROW, kv[0] if kv else 0, n, True))  # type: ignore[arg-type]
    for text in decodes:
        rows, *kv = _ints(text, "--decode", 2)
        for _ in range(rows):
            batch.add_generation(_ROW, kv[0] if kv else 0)  # type: ignore[arg-type]
    if not batch:
        raise ValueError("step-cost: give at least one --decode B:KV or --prefill N[:KV]")
    return batch.work()
