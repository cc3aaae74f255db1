"""What a run that rejected requests prints under its summary: how many, the commonest reason, and the
option that would change it."""

from __future__ import annotations

import re
from collections import Counter

from harness.source import UNSENT
from strategies.runtime.request import Request, Status

# (words in a rejection reason, the options that would admit such a request)
HINTS = [("exceeds max_seq_len", "raise --max-seq-len (its default is the model's context length, capped by "
                                 "--kv-blocks)"),
         ("exceeds max_num_tokens", "raise --max-num-tokens, or leave --chunked-prefill on"),
         ("cross-attention KV blocks", "raise --kv-blocks"),
         ("KV blocks than the cache has", "raise --kv-blocks (or lower --max-seq-len / output lengths)"),
         ("beam width", "raise --max-batch-size (a request's beams are rows of one batch)"),
         ("encoder input (", "raise --max-num-tokens and --max-seq-len (an encoder input is encoded whole)"),
         ("outside the vocabulary", "check the trace's token ids against the model's vocabulary")]


def rejection_note(strategy: str, requests: list[Request]) -> str | None:
    """One line for a strategy that rejected requests, or None if it rejected none."""
    reasons = [r.finish_reason or "" for r in requests if r.status is Status.REJECTED]
    if not reasons:
        return None
    # A session's turn never sent because an earlier one was rejected: counted, the cause named instead.
    unsent = sum(x.startswith(UNSENT) for x in reasons)
    causes = [x for x in reasons if not x.startswith(UNSENT)] or reasons
    kinds = Counter(re.sub(r"\d+", "N", x) for x in causes)  # the same reason with each request's numbers
    kind, count = kinds.most_common(1)[0]
    example = next(x for x in causes if re.sub(r"\d+", "N", x) == kind)
    hint = next((h for words, h in HINTS if words in example), None)
    sessions = f" ({unsent} of them later turns of sessions that ended there)" if unsent else ""
    return (f"note: {strategy} rejected {len(reasons)} of {len(requests)} requests{sessions}; commonest reason "
            f"({count}): {example}" + (f" — {hint}" if hint else ""))
