"""Speculative decoding on the host: the drafts a request verifies (schedule), then what each verifying
request received and the KV it gives back (postprocess).

A verifying request computed positions p..p+k (its last token, then its drafts) and receives n tokens
(the drafts the target agreed with, then the target's own). Keys are valid at p..p+n-1 — the inputs
there equal what the request now holds — so its computed count rewinds to p + n: the rejected positions
are never read (the next step starts at p + n and overwrites them) and never enter the prefix cache.
Under max-utilization the blocks past what the next step needs go back to the pool at once; under
guaranteed-no-evict, and in static batching, they are the request's reservation and stay.
"""

from __future__ import annotations

import numpy as np

from strategies.runtime.buffers.draft_tokens import DraftTokens
from strategies.runtime.decoder.finish import CONTINUE, DISCARDED, FINISH_REASONS
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.request import Request, Status
from strategies.runtime.spec.config import SpecConfig
from strategies.runtime.spec.ngram import propose_ngram


def propose_drafts(r: Request, spec: SpecConfig, budget: int) -> np.ndarray:
    """``r``'s drafts for this step (empty: it decodes one token as usual). They never reach past
    max_new_tokens (at most the tokens it may still generate, less the one the target always adds) nor
    past the step's remaining token ``budget`` (the row's last token takes one).

    Overlap prepares a step while the request's last token is still on the device (pending). The lookup
    then runs on the tokens before it and continues one token further: the continuation's first token
    stands for the pending one and the rest are the drafts. Nothing rests on that guess being right: the
    verifying chunk starts with the real token (read on the device), so the target checks every draft
    against what truly precedes it; a wrong guess only makes a match unlikely."""
    if r.pending_samples > 1 or r.verifying:  # a verifying step in flight: its next position is unknown
        return r.token_ids[:0]
    k = min(spec.num_speculative_tokens, r.max_new_tokens - r.num_output_tokens - r.pending_samples - 1, budget - 1)
    if k <= 0:
        return r.token_ids[:0]
    if spec.acceptance_rate is not None:  # the simulated device decides acceptance: any k tokens will do
        return np.repeat(r.token_ids[-1:], k)
    if spec.method == "draft_model":  # k places the draft engine fills before the step (spec/draft_model.py)
        return np.zeros(k, dtype=np.int64)
    found = propose_ngram(r.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, k + r.pending_samples)
    return found[r.pending_samples:]


def receive_verified(rec: IterationRecord, drafts: DraftTokens, outputs: list[list[int]], now: float,
                     kv: BlockManager | None) -> list[tuple[Request, str]]:
    """Hand each verifying request its tokens; returns the requests that finished, with their reasons.
    ``kv``: the block manager to trim rejected positions' blocks from (None: keep them reserved)."""
    k1 = drafts.k + 1
    by_position = [0] * drafts.k
    done: list[tuple[Request, str]] = []
    for i, (r, p, row) in enumerate(zip(drafts.rows, drafts.positions, outputs, strict=True)):
        r.pending_samples -= 1
        r.verifying = False
        n, code, got = row[k1], row[k1 + 1], row[k1 + 2]
        if code == DISCARDED or r.status is not Status.RUNNING:  # finished, or preempted after scheduling
            # nothing reached the request: the chunk's 1 + k computed tokens are padding (its drafts are not
            # counted as proposed)
            rec.num_padding_tokens += 1 + int(drafts.num_drafts.np[i])
            continue
        rec.spec_drafts += 1  # vLLM counts the verifications it reads
        rec.spec_draft_tokens += int(drafts.num_drafts.np[i])
        for j in range(n):
            r.append_token(row[j], now)
        for j in range(got):
            by_position[j] += 1
        rec.spec_accepted_tokens += got
        r.num_computed_tokens = p + n
        # a draft model's keys are right where its input was: p, then the drafts received, up to its last input
        r.draft_computed = min(r.draft_computed, p + 1 + min(got, int(drafts.num_drafts.np[i]) - 1))
        if kv is not None:
            kv.trim(r.slot, p + n + 1)
        if code != CONTINUE:
            done.append((r, FINISH_REASONS[code]))
    rec.spec_accepted_by_position = tuple(by_position)
    return done
