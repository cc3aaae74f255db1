"""Attention over the paged KV cache, shared by every model family (Llama, BART's decoder).

``attention_indices`` turns the step's block table (and the cache indirection, with beam search) into
the page indices each context chunk and each single-query row reads; ``paged_attention`` writes the step's
keys/values into their pages and attends — long context chunks one by one (a whole prompt reads only its own
keys; a later chunk reads its pages, causal with an offset), and every other token as a row of one batched
call per layer (every row's pages gathered head-major, positions past each row's own masked): the generation
rows, and — where the step is batched so (``batch_chunks``) — the tokens of short chunks that continue a
sequence (speculative decoding's verify chunks, a draft model's catch-up passes: up to ``ROW_CHUNK_MAX``
tokens), which would otherwise cost a kernel or more each per layer. Both are TorchScript, called from inside
the scripted model.
"""

from __future__ import annotations

import torch

ROW_CHUNK_MAX = 16  # a chunk of at most this many tokens that continues a sequence attends as single-query rows


@torch.jit.script
def page_index(table_row: torch.Tensor, positions: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
    """Flat page index of each position for one block-table row: block * tokens_per_block + offset."""
    return table_row[positions // tokens_per_block] * tokens_per_block + positions % tokens_per_block


@torch.jit.script
def attention_indices(tokens: torch.Tensor, block_table: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
                      ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int, tokens_per_block: int,
                      cache_indirection: torch.Tensor, max_beam: int, like: torch.Tensor,
                      batch_chunks: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ctx_kv: per context chunk, the pages it reads — empty for a whole prompt, and for a chunk whose tokens
    attend as rows; rows [R']: the token rows that attend one query each — empty: the generation rows, the
    tokens after ``num_ctx_tokens``; row_kv [R'*K]: their pages; row_mask [1, R', 1, K]: additive, 0 or -inf,
    in ``like``'s dtype). ``batch_chunks``: short continuing chunks' tokens attend as rows (without beam search)."""
    positions = tokens[:, 1]
    dev = tokens.device
    ctx_kv: list[torch.Tensor] = []
    chunk_rows: list[torch.Tensor] = []  # the token rows of chunks that attend as rows
    chunk_tables: list[torch.Tensor] = []  # each such row's block-table row
    batched = batch_chunks and cache_indirection.size(0) == 0
    row_chunk_max = 16  # ROW_CHUNK_MAX (a scripted function reads no module constant)
    kmax = gen_kmax
    for i in range(len(ctx_starts)):
        s, n, p0 = ctx_starts[i], ctx_lens[i], ctx_pos0[i]
        if batched and p0 > 0 and n <= row_chunk_max:
            ctx_kv.append(torch.empty(0, dtype=torch.long, device=dev))
            chunk_rows.append(torch.arange(s, s + n, device=dev))
            chunk_tables.append(torch.full([n], i, dtype=torch.long, device=dev))
            kmax = max(kmax, p0 + n)
        elif p0 > 0:
            ctx_kv.append(page_index(block_table[i], torch.arange(p0 + n, device=dev), tokens_per_block))
        else:
            ctx_kv.append(torch.empty(0, dtype=torch.long, device=dev))
    g = tokens.size(0) - num_ctx_tokens
    kpos = torch.arange(kmax, device=dev)  # [K]
    if len(chunk_rows) > 0:  # the chunks' tokens, then the generation rows: one row each
        n_ctx = len(ctx_starts)
        chunk_rows.append(torch.arange(num_ctx_tokens, num_ctx_tokens + g, device=dev))
        chunk_tables.append(torch.arange(n_ctx, n_ctx + g, device=dev))
        rows = torch.cat(chunk_rows)  # [R']
        tables = torch.cat(chunk_tables)  # [R']
        table = block_table.index_select(0, tables)  # [R', W] (W holds every row's blocks: K <= W pages)
        row_kv = (table[:, kpos // tokens_per_block] * tokens_per_block + kpos % tokens_per_block).flatten()  # [R'*K]
        hidden = (kpos.unsqueeze(0) > positions.index_select(0, rows).unsqueeze(1)).view(1, rows.size(0), 1, kmax)
    else:
        rows = torch.empty(0, dtype=torch.long, device=dev)
        table = block_table[len(ctx_starts):len(ctx_starts) + g]  # [G, W]
        if cache_indirection.size(0) > 0 and g > 0:
            # Each position is read from the beam that wrote it: the table row (this row - its beam + source).
            decoder_rows = tokens[num_ctx_tokens:, 2]  # [G]
            source = cache_indirection[:, :kmax].index_select(0, decoder_rows)  # [G, K] beam per position
            table_row = (torch.arange(g, device=dev) - decoder_rows % max_beam).unsqueeze(1) + source
            row_kv = (table[table_row, kpos // tokens_per_block] * tokens_per_block
                      + kpos % tokens_per_block).flatten()  # [G*K]
        else:
            row_kv = (table[:, kpos // tokens_per_block] * tokens_per_block + kpos % tokens_per_block).flatten()
        hidden = (kpos.unsqueeze(0) > positions[num_ctx_tokens:].unsqueeze(1)).view(1, g, 1, kmax)
    # Additive (0 / -inf) rather than boolean: SDPA's CPU kernel takes it measurably faster.
    row_mask = torch.zeros(hidden.shape, dtype=like.dtype, device=dev).masked_fill(hidden, float("-inf"))
    return ctx_kv, rows, row_kv, row_mask


@torch.jit.script
def step_indices(tokens: torch.Tensor, block_table: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int],
                 ctx_pos0: list[int], num_ctx_tokens: int, gen_kmax: int, tokens_per_block: int,
                 last_token: torch.Tensor, cache_indirection: torch.Tensor, max_beam: int, like: torch.Tensor,
                 batch_chunks: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A model step's preamble: the generation rows' input ids read from the decoder state's last tokens
    (in place, into ``tokens[:, 0]``: they never visit the host), then ``attention_indices``."""
    if tokens.size(0) > num_ctx_tokens:
        tokens[num_ctx_tokens:, 0] = last_token[tokens[num_ctx_tokens:, 2]]
    return attention_indices(tokens, block_table, ctx_starts, ctx_lens, ctx_pos0, num_ctx_tokens, gen_kmax,
                             tokens_per_block, cache_indirection, max_beam, like, batch_chunks)


@torch.jit.script
def generation_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, gen_kv: torch.Tensor,
                         gen_mask: torch.Tensor) -> torch.Tensor:
    """One query per row, batched: every row's pages gathered (head-major, so the gather is matmul-ready
    without a transpose copy) and the positions each row may not see masked. q [G, H, D] → [G, H, D]."""
    g, num_heads, head_dim = q.size(0), q.size(1), q.size(2)
    num_kv_heads, kmax = k_pool.size(0), gen_mask.size(-1)
    qh = q.reshape(g, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [Hkv, G, grp, D]
    keys = k_pool.index_select(1, gen_kv).view(num_kv_heads, g, kmax, head_dim)  # [Hkv, G, K, D]
    values = v_pool.index_select(1, gen_kv).view(num_kv_heads, g, kmax, head_dim)
    o = torch.nn.functional.scaled_dot_product_attention(qh, keys, values, attn_mask=gen_mask)  # [Hkv, G, grp, D]
    return o.transpose(0, 1).reshape(g, num_heads, head_dim)


@torch.jit.script
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    kv_index: torch.Tensor, ctx_starts: list[int], ctx_lens: list[int], ctx_pos0: list[int],
                    ctx_kv: list[torch.Tensor], num_ctx_tokens: int, rows: torch.Tensor, row_kv: torch.Tensor,
                    row_mask: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (positions applied); pools [Hkv, pages, D]; ``rows`` [R'] the token rows
    that attend as single queries (empty: the generation rows after ``num_ctx_tokens``); returns [T, H, D]."""
    t = q.size(0)
    # Write this step's keys/values into their pages first: a token attends to itself too.
    k_pool.index_copy_(1, kv_index, k.transpose(0, 1))
    v_pool.index_copy_(1, kv_index, v.transpose(0, 1))
    out = torch.empty_like(q)  # [T, H, D]
    for i in range(len(ctx_starts)):
        s, n, p0 = ctx_starts[i], ctx_lens[i], ctx_pos0[i]
        if p0 > 0 and ctx_kv[i].size(0) == 0:  # its tokens attend as rows, below
            continue
        # 4-D views: the batched layout takes PyTorch's fused CPU kernel (2x the 3-D path's speed).
        qi = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p0 == 0:  # a whole prompt: its own keys are all it attends to, no page is read
            ki = k[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            vi = v[s:s + n].transpose(0, 1).unsqueeze(0)
            oi = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        else:  # a later chunk, or a prompt whose prefix was cached: read the pages, causal with an offset
            ki = k_pool.index_select(1, ctx_kv[i]).unsqueeze(0)  # [1, Hkv, p0 + n, D]
            vi = v_pool.index_select(1, ctx_kv[i]).unsqueeze(0)
            qpos = torch.arange(p0, p0 + n, device=q.device).unsqueeze(1)  # [n, 1]
            mask = torch.arange(p0 + n, device=q.device).unsqueeze(0) <= qpos  # [n, p0 + n]
            oi = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
        out[s:s + n] = oi[0].transpose(0, 1)
    if rows.size(0) > 0:
        out.index_copy_(0, rows, generation_attention(q.index_select(0, rows), k_pool, v_pool, row_kv, row_mask))
    elif t > num_ctx_tokens:
        out[num_ctx_tokens:] = generation_attention(q[num_ctx_tokens:], k_pool, v_pool, row_kv, row_mask)
    return out
