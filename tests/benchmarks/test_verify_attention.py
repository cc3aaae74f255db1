"""Verify chunks in paged attention: a step of 64 requests each verifying 4 drafts (a chunk of 5 tokens that
continues its sequence) costs one batched attention call per layer, where it cost a call chain per chunk.

Counted, not timed: the operators one layer's attention runs (``torch.profiler``; on a GPU each is at least one
kernel launch), per chunk (``batch_chunks=False``, the arrangement before, still BART's) and batched, over the
same pages, and the outputs compared (float64). Printed per step of a 32-layer model:
``python -m pytest -s tests/benchmarks/test_verify_attention.py``.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from strategies.runtime.kv.paged_attention import ROW_CHUNK_MAX, attention_indices, paged_attention

ROWS, K, LAYERS, TPB = 64, 4, 32, 16
HEADS, KV_HEADS, DIM = 8, 2, 16


def _step(k: int = K) -> tuple:
    """64 verify chunks of k + 1 tokens at positions 90-153, each request on blocks of its own."""
    g = torch.Generator().manual_seed(0)
    starts, lens, pos0 = [], [], []
    blocks_per_row = 12
    tokens, table = [], torch.zeros(ROWS, blocks_per_row, dtype=torch.long)
    for i in range(ROWS):
        p0 = 90 + i
        starts.append(i * (k + 1))
        lens.append(k + 1)
        pos0.append(p0)
        table[i] = torch.arange(i * blocks_per_row, (i + 1) * blocks_per_row)
        for j in range(k + 1):
            p = p0 + j
            tokens.append([0, p, i, int(table[i, p // TPB]) * TPB + p % TPB])
    tokens = torch.tensor(tokens)  # [T, 4]
    t, pages = tokens.size(0), ROWS * blocks_per_row * TPB
    q = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(t, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(t, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    k_pool = torch.randn(KV_HEADS, pages, DIM, generator=g, dtype=torch.float64)
    v_pool = torch.randn(KV_HEADS, pages, DIM, generator=g, dtype=torch.float64)
    return tokens, table, starts, lens, pos0, q, k, v, k_pool, v_pool


def _layer(batch_chunks: bool, drafts: int = K) -> tuple[torch.Tensor, dict[str, int]]:
    """One layer's attention over the step (its indices made once a step, as the model does), and the
    operators it ran, by name."""
    tokens, table, starts, lens, pos0, q, k, v, k_pool, v_pool = _step(drafts)
    t = tokens.size(0)
    no_beams = torch.empty((0, 0), dtype=torch.long)
    ctx_kv, rows, row_kv, row_mask = attention_indices(tokens, table, starts, lens, pos0, t, 0, TPB, no_beams, 1,
                                                       k_pool, batch_chunks)
    args = (q, k, v, k_pool, v_pool, tokens[:, 3], starts, lens, pos0, ctx_kv, t, rows, row_kv, row_mask)
    paged_attention(*args)  # (scripted: its first call is profiled and optimised)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = paged_attention(*args)
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    return out, ops


def test_verify_chunks_attend_in_one_call_per_layer():
    chunked, per_chunk = _layer(False)
    batched, once = _layer(True)
    assert torch.allclose(batched, chunked, rtol=0, atol=1e-12)  # the same attention, to float64's rounding
    sdpa = "aten::scaled_dot_product_attention"
    assert per_chunk[sdpa] == ROWS and once[sdpa] == 1
    before, after = sum(per_chunk.values()), sum(once.values())
    print(f"\n{ROWS} verify chunks of {K + 1} tokens, {LAYERS} layers: attention calls per step "
          f"{per_chunk[sdpa] * LAYERS} -> {once[sdpa] * LAYERS}; operators per step {before * LAYERS} -> "
          f"{after * LAYERS}")
    assert after * 10 < before


def test_chunks_up_to_row_chunk_max_attend_as_rows_and_longer_ones_alone():
    """The scripted rule's limit is ``ROW_CHUNK_MAX`` (a literal inside the scripted function): chunks of that
    many tokens share one call, one token more and each chunk has its own."""
    _, at_limit = _layer(True, ROW_CHUNK_MAX - 1)
    _, past = _layer(True, ROW_CHUNK_MAX)
    sdpa = "aten::scaled_dot_product_attention"
    assert at_limit[sdpa] == 1 and past[sdpa] == ROWS
