"""Attention on a GPU: thread blocks in rounds over the streaming multiprocessors (SMs).

A roofline over a step's attention bytes or FLOPs assumes every SM busy. FlashAttention-style kernels
launch one thread block per (sequence, KV head) in decode and per (128-query tile, head) in prefill, one
block per SM at a time here: with few blocks SMs idle, a last partial round runs each of its blocks at
most at what one block can draw, and every block pays a fixed cost (set-up, softmax, write-out) that KV
bytes do not show. Vidur's measured A100 table for Llama-2-7B (FlashAttention-2) shows all three: decode
at 32 cached tokens costs ~1.2 us per sequence whatever its bytes, a batch of 7 x 2,432 tokens takes 1.6x
a batch of 6 (224 blocks: a third round on 108 SMs), and 128 x 2,368 reaches ~97% of peak bandwidth.
Prefill prices each round by its slowest block. On that table a chunk's tiles each cost what its last one
does (every key of its context); FlashAttention-3 on Hopper skips the keys a tile's causal mask hides, so
there each tile reads its own (``DeviceProfile.prefill_causal``). The profile's parameters were fitted to
those tables (docs/simulator.md has the figures).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strategies.runtime.sim.profile import DeviceProfile

Q_TILE = 128  # queries per prefill thread block
KV_TILE = 128  # keys per split unit of a decode sequence


@lru_cache(maxsize=4096)  # called every simulated step with few distinct arguments
def kv_splits(blocks: int, kv_tiles: int, sms: int) -> int:
    """How many parts each decode sequence's KV is split into, after FlashAttention-2's heuristic: none
    when the blocks fill 80% of the SMs, else the fewest parts whose rounds are at least 85% as full as
    the best split's."""
    if blocks >= 0.8 * sms:
        return 1
    fill = [blocks * s / sms / math.ceil(blocks * s / sms) for s in range(1, max(1, min(sms, kv_tiles, 128)) + 1)]
    best = max(fill)
    return next(s for s, f in enumerate(fill, 1) if f >= 0.85 * best)


def rounds_s(blocks: int, work: float, sms: int, full_rate: float, block_rate: float, block_s: float) -> float:
    """Seconds for ``blocks`` equal thread blocks of ``work`` (bytes or FLOPs) each, one per SM at a time:
    full rounds share ``full_rate`` across the SMs; a partial round of k blocks runs each at
    min(``block_rate``, full_rate / k). Each block's fixed cost and its transfer or math partly overlap
    (their root sum of squares: the fit to the measured table, between their sum and their max)."""
    full, tail = divmod(blocks, sms)
    secs = full * math.hypot(block_s, work * sms / full_rate)
    if tail:
        secs += math.hypot(block_s, work / min(block_rate, full_rate / tail))
    return secs


def decode_attention_s(p: DeviceProfile, rows: int, kv_tokens: float, kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> float:
    """One layer's decode attention on one rank: ``rows`` sequences reading ``kv_tokens`` KV entries in
    all (their contexts and the tokens written this step), ``kv_heads`` KV heads each."""
    if not rows:
        return 0.0
    sms, blocks = p.gpu.sms, rows * kv_heads
    splits = kv_splits(blocks, math.ceil(kv_tokens / rows / KV_TILE), sms)
    work = kv_tokens / rows * 2 * head_dim * dtype_bytes / splits  # K and V bytes per block (one head)
    bw = p.gpu.mem_bw
    return rounds_s(blocks * splits, work, sms, bw * p.attn_eff_bw, bw / sms * p.attn_block_bw, p.attn_block_s)


def prefill_attention_s(p: DeviceProfile, chunks: Sequence[tuple[float, float]], heads: int, head_dim: int) -> float:
    """One layer's prefill attention on one rank over ``chunks``: each (queries, keys) — a chunk's tokens and
    its context (cached tokens plus the chunk itself) — ``heads`` heads, all in one varlen launch.

    Each chunk runs ceil(queries / Q_TILE) tiles a head (``chunk_tiles``): where the profile's kernel skips the
    keys a causal mask hides (``prefill_causal``), tile j reads the cached keys and the chunk's up to its last
    query, so a cold 4,096-token prompt costs about half of what pricing every tile at the chunk's last does;
    else every tile is priced as that last one. The blocks go to the SMs slowest first, in rounds of one block
    an SM; a round takes as long as its slowest block. So a cold 575-token prompt beside twenty 20-token chunks
    costs its own tiles' rounds and the small chunks' rounds after them, where a mean over the chunks (21 chunks
    of 46 tokens) priced no tile at the prompt's size."""
    # (one block's FLOPs, its rows, its blocks): a chunk's tiles, slowest first; each tile runs `heads` blocks
    groups = sorted(((rows * keys * 4 * head_dim, rows, n * heads) for q, k in chunks
                     for rows, keys, n in chunk_tiles(q, k, p.prefill_causal)), reverse=True)
    sms, peak = p.gpu.sms, p.gpu.peak_flops
    full_rate, block_rate = peak * p.attn_eff_flops, peak / sms * p.prefill_block_flops
    total = sum(g[2] for g in groups)
    secs, g, end = 0.0, 0, groups[0][2] if groups else 0  # `end`: the blocks up to and including group g
    for first in range(0, total, sms):  # a round of up to `sms` blocks, priced by its first (slowest) block
        while end <= first:
            g += 1
            end += groups[g][2]
        work, rows, _ = groups[g]
        secs += rounds_s(min(sms, total - first), work, sms, full_rate, block_rate, tile_block_s(p, rows))
    return secs


def chunk_tiles(queries: float, keys: float, causal: bool) -> list[tuple[float, float, int]]:
    """(rows, keys, how many) of the query tiles of a chunk of ``queries`` tokens whose context holds ``keys``
    (cached tokens and the chunk). ``causal``: tile j attends to the cached keys and the chunk's first
    j·Q_TILE + rows (the kernel skips the masked key blocks, as FlashAttention-3 does); else every tile is
    priced as the chunk's last, a full one reading every key (what the A100 fit assumed)."""
    tiles = math.ceil(queries / Q_TILE) if queries > 0 else 0
    if not causal:
        return [(min(Q_TILE, queries), keys, tiles)] if tiles else []
    cached = keys - queries
    return [(min(Q_TILE, queries - j * Q_TILE), cached + min(queries, (j + 1) * Q_TILE), 1) for j in range(tiles)]


def equal_chunks(chunks: int, tokens: int, context_tokens: float) -> list[tuple[float, float]]:
    """``chunks`` chunks of ``tokens`` queries in all, whose contexts hold ``context_tokens`` keys in all, as
    equal chunks (the mean's shape; where a step's own chunks are not known)."""
    if not tokens:
        return []
    chunks = max(chunks, 1)
    return [(tokens / chunks, context_tokens / chunks)] * chunks


def tile_block_s(p: DeviceProfile, rows: float) -> float:
    """The fixed cost of a thread block of ``rows`` queries: a decode block's (one query) at 1, a full prefill
    tile's at Q_TILE, and between them in proportion to the rows — loading the queries, their softmax state
    and writing their outputs scale with the rows. A chunk shorter than a tile (a prompt mostly read from the
    prefix cache, a verify chunk) then costs about what as many decode rows do, as in a varlen kernel that
    runs both (vLLM V1's FlashAttention), not what a full tile does. The two ends are fitted on the A100's table
    (docs/simulator.md); on Hopper both are the decode block's, assumed (its table's long prompts do not show a
    block's cost). The straight line between them is an assumption no measured short chunk has checked."""
    if rows >= Q_TILE:
        return p.prefill_block_s
    return p.attn_block_s + (p.prefill_block_s - p.attn_block_s) * (max(rows, 1.0) - 1) / (Q_TILE - 1)
