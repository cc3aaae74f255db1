"""Prompt token ids for trace requests, and the prefix reuse a trace offers.

A request's prompt is, in order: its explicit ids (slotbench JSONL), or the tokens of its shared-prefix
blocks (Mooncake ``hash_ids``: one id per block of the trace's block size; synthetic ``--prefix-len``)
cut to its length, then seeded random ids for whatever is left. A block id always stands for the same
tokens, so requests that share ids share prefixes, as in the trace.

``ideal_prefix_hit_rate`` says how much of a trace's prompts an infinite cache could serve, counted the
way slotbench's block manager counts a hit (full ``tokens_per_block`` blocks of a chain that an earlier
request computed, never the last prompt token) but computed from the block ids alone, without building
a token or hashing one: an independent reckoning of what a run with a large cache must measure.
"""

from __future__ import annotations

import numpy as np

from harness.traces.trace import TraceRequest

POOL_IDS = 1 << 16  # random ids drawn at a time


class PromptBuilder:
    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self._blocks: dict[tuple[int, int], np.ndarray] = {}
        self._pool = np.zeros(0, dtype=np.int64)  # the seeded stream's next ids, from ``_at`` on
        self._at = 0

    def _random(self, n: int) -> np.ndarray:
        """[n] the seeded stream's next ``n`` ids (a new array). Drawn ahead, ``POOL_IDS`` at a time: numpy's
        bounded integers keep no state between calls but the generator's, so one draw gives the ids that draws
        of its parts in turn give (tests/test_traces.py), without a draw's overhead per prompt (10,000
        prompts: ~0.1 s)."""
        if self._at + n > len(self._pool):
            more = self.rng.integers(0, self.vocab_size, size=max(n, POOL_IDS), dtype=np.int64)
            self._pool, self._at = np.concatenate((self._pool[self._at:], more)), 0
        self._at += n
        return self._pool[self._at - n:self._at].copy()

    def block(self, block_id: int, length: int) -> np.ndarray:
        """The tokens a prefix-block id stands for: a pure function of (id, length, vocabulary)."""
        key = (block_id, length)
        if key not in self._blocks:
            rng = np.random.default_rng([block_id & 0xFFFFFFFFFFFF, length, self.vocab_size, 0x51B])
            self._blocks[key] = rng.integers(0, self.vocab_size, size=length, dtype=np.int64)
        return self._blocks[key]

    def encoder_prompt(self, t: TraceRequest) -> np.ndarray | None:
        """The encoder's input (encoder–decoder models), or None when the request has none."""
        if t.encoder_prompt_token_ids is not None:
            return np.asarray(t.encoder_prompt_token_ids, dtype=np.int64)
        if not t.encoder_tokens:
            return None
        return self._random(t.encoder_tokens)

    def prompt(self, t: TraceRequest) -> np.ndarray:
        if t.prompt_token_ids is not None:
            return np.asarray(t.prompt_token_ids, dtype=np.int64)
        if not t.prefix_ids:
            return self._random(t.input_tokens)
        out = np.empty(t.input_tokens, dtype=np.int64)
        n = 0
        for block_id in t.prefix_ids:
            if n >= t.input_tokens:
                break
            b = self.block(block_id, t.prefix_block_len)[: t.input_tokens - n]
            out[n:n + len(b)] = b
            n += len(b)
        out[n:] = self._random(t.input_tokens - n)
        return out


def ideal_prefix_hit_rate(requests: list[TraceRequest] | tuple[TraceRequest, ...], tokens_per_block: int) -> float:
    """Prompt tokens an infinite cache serves / prompt tokens, requests in arrival order.

    Block k of a prompt (tokens [k·tpb, (k+1)·tpb)) is determined by the prefix ids that cover those
    tokens and by k; it is a hit when an earlier request computed the same (ids, k). A request computes
    every full block of its prompt; it may reuse at most (prompt − 1) // tpb of them. Tokens past the
    prefix blocks are random and never hit; explicit prompts are keyed by their tokens."""
    seen: set[tuple] = set()
    chains: dict[tuple, int] = {}  # (chain of the ids before, id) → a small int naming the id prefix
    hit = total = 0
    for t in requests:
        total += t.input_tokens
        full = t.input_tokens // tokens_per_block
        keys = _block_keys(t, full, tokens_per_block, chains)
        cap = (t.input_tokens - 1) // tokens_per_block
        n = 0
        while n < cap and keys[n] is not None and keys[n] in seen:
            n += 1
        hit += n * tokens_per_block
        seen.update(k for k in keys if k is not None)
    return hit / total if total else 0.0


def _block_keys(t: TraceRequest, full: int, tpb: int, chains: dict[tuple, int]) -> list[tuple | None]:
    """What determines each full block's tokens (and so its hash chain); None for a random block."""
    if t.prompt_token_ids is not None:
        return [("tokens", tuple(t.prompt_token_ids[:(k + 1) * tpb])) for k in range(full)]
    ids = t.prefix_ids or ()
    chain, prev = [], -1
    for i in ids:  # chain[j] names ids[:j + 1]
        prev = chains.setdefault((prev, i), len(chains))
        chain.append(prev)
    keys: list[tuple | None] = []
    for k in range(full):
        covering = -(-(k + 1) * tpb // t.prefix_block_len) if ids else 0
        keys.append(("ids", t.prefix_block_len, chain[covering - 1], k) if 0 < covering <= len(ids) else None)
    return keys
