"""The device sampler: greedy, temperature, top-k, top-p and min-p, per request, as pure tensor code.

Filters follow Hugging Face's semantics and order (TopK → TopP on the renormalised survivors → MinP, as
vLLM also applies them).

Randomness is counter-based: the noise for (seed, step, vocabulary index) is a hash of those three
numbers, turned into Gumbel noise. A request's draw therefore depends only on its own seed and how many
tokens it has generated — never on the batch around it, the slot it holds, or the strategy that ran it.
Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


@torch.jit.script
def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 (Chris Wellons). Values stay in [0, 2**32); int64 products wrap but their low 32 bits
    # are exact, and the mask keeps every right shift logical.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@torch.jit.script
def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1) of shape [B, vocab]: a pure function of (seed, step, vocab index)."""
    key = _mix32((seeds & 0xFFFFFFFF) ^ _mix32((steps * 0x9E3779B1 + 0x632BE5AB) & 0xFFFFFFFF))  # [B]
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    h = _mix32(((key.unsqueeze(1) * 0x85EBCA77) & 0xFFFFFFFF) ^ idx.unsqueeze(0))  # [B, V]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


@torch.jit.script
def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Hugging Face's warpers in its order: top-k, then top-p on the renormalised survivors, then min-p;
    removed tokens become -inf. scaled [B, V] (temperature applied); per-row parameters [B], where
    top_k 0, top_p 1 and min_p 0 disable a filter."""
    vocab = scaled.size(1)
    # Ascending, as HF's TopP sorts: its softmax and cumulative sum then run over the same array in the
    # same order, so borderline tokens agree to the bit.
    ascending = torch.sort(scaled, dim=-1)[0]  # [B, V]
    pos = torch.arange(vocab, device=scaled.device).unsqueeze(0)  # [1, V] rank from the least likely
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [B, 1]
    remove = pos < vocab - k  # [B, V] below the k most likely
    probs = torch.softmax(ascending.masked_fill(remove, float("-inf")), dim=-1)  # [B, V] over top-k survivors
    # HF's TopP: drop tokens whose cumulative mass, summed from the least likely up, is <= 1 - top_p; the
    # most likely token always stays.
    remove = remove | ((probs.cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)) & (pos < vocab - 1))
    # MinP compares to the most likely token: a ratio, so the renormalisation after top-p does not move it.
    remove = remove | (probs < (min_p * probs[:, -1]).unsqueeze(1))
    # Each filter removes the least likely end of the sorted row, so the survivors are the tokens at or
    # above the least likely one kept: a threshold per row, applied in vocabulary order (no scatter of
    # the sorted row back). A token tied with that one stays too, as HF's top-k keeps ties.
    removed = remove.sum(dim=-1, keepdim=True)  # [B, 1] <= V - 1: the most likely token always stays
    threshold = ascending.gather(1, removed)  # [B, 1]
    return scaled.masked_fill(scaled < threshold, float("-inf"))


@torch.jit.script
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, use_filters: bool,
           any_random: bool = True) -> torch.Tensor:
    """One token per row. logits [B, V]; per-row parameters [B]. ``use_filters`` and ``any_random`` are
    host-known flags (some row uses top-k/top-p/min-p; some row samples at all) that skip the sort and
    the noise when nobody needs them — a branch on what the host already knows, not on tensor values."""
    # torch.max's indices: the first maximum, like argmax, and ~3x faster on CPU.
    greedy = torch.max(logits, dim=-1)[1]  # [B]
    if not any_random:
        return greedy
    vocab = logits.size(1)
    scaled = logits.float() / temperature.clamp(min=1e-6).unsqueeze(1)  # [B, V]
    if use_filters:
        scaled = filter_logits(scaled, top_k, top_p, min_p)
    u = counter_uniform(seeds, steps, vocab)
    gumbel = -torch.log(-torch.log(u))  # [B, V]
    sampled = torch.max(scaled + gumbel, dim=-1)[1]  # [B]
    return torch.where(temperature > 0, sampled, greedy)
