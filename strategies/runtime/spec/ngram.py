"""The n-gram proposer (prompt lookup), with vLLM's semantics: the longest suffix n-gram, n in
[min, max], found earlier in the request's own tokens (prompt and outputs); its earliest occurrence; and
up to k tokens that followed it. Hugging Face's ``prompt_lookup_num_tokens`` chooses the same way
(longest n first, first match). Host code: the drafts need the tokens the host has read back."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens for ``tokens [L]`` (empty: no earlier occurrence of any suffix n-gram)."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # [L - n, n] every n-gram but the suffix itself
        hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start:start + k]
    return tokens[:0]
