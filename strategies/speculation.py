"""Speculative decoding's postprocess: what each verifying request received, and the KV it gives back.

A verifying request computed positions p..p+k (its last token, then its drafts) and receives n tokens
(the drafts the target agreed with, then the target's own). Keys are valid at p..p+n-1 — the inputs
there equal what the request now holds — so its computed count rewinds to p + n: the rejected positions
are never read (the next step starts at p + n and overwrites them) and never enter the prefix cache.
Under max-utilization the blocks past what the next step needs go back to the pool at once; under
guaranteed-no-evict they are the request's reservation and stay.
"""

from __future__ import annotations

from strategies.runtime.buffers.draft_tokens import DraftTokens
from strategies.runtime.decoder.state import CONTINUE, DISCARDED, FINISH_REASONS
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.request import Request, Status


def receive_verified(rec: IterationRecord, drafts: DraftTokens, outputs: list[list[int]], now: float,
                     kv: BlockManager | None) -> list[tuple[Request, str]]:
    """Hand each verifying request its tokens; returns the requests that finished, with their reasons.
    ``kv``: the block manager to trim rejected positions' blocks from (None: keep them reserved)."""
    k1 = drafts.k + 1
    by_position = [0] * drafts.k
    done: list[tuple[Request, str]] = []
    for r, p, row in zip(drafts.rows, drafts.positions, outputs, strict=True):
        r.pending_samples -= 1
        n, code, got = row[k1], row[k1 + 1], row[k1 + 2]
        if code == DISCARDED or r.status is not Status.RUNNING:  # finished, or preempted after scheduling
            rec.num_padding_tokens += 1
            continue
        for j in range(n):
            r.append_token(row[j], now)
        for j in range(got):
            by_position[j] += 1
        rec.spec_accepted_tokens += got
        r.num_computed_tokens = p + n
        if kv is not None:
            kv.trim(r.slot, p + n + 1)
        if code != CONTINUE:
            done.append((r, FINISH_REASONS[code]))
    rec.spec_accepted_by_position = tuple(by_position)
    return done
