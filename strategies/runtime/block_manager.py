"""The KV cache's blocks: who holds which, and which full blocks can be reused by content.

Each slot has a row in a host-side block table (``table [slots, max_blocks_per_seq]``, TensorRT-LLM's
block offsets, vLLM's block table) listing its request's blocks in position order; ``prepare`` copies
the rows of a step's requests into the runtime buffers. Blocks carry reference counts, because with
prefix caching several requests can hold the same block.

Prefix caching (vLLM, TensorRT-LLM): a full block is identified by a hash chained over (the previous
block's hash, its token ids), so equal hashes mean equal prefixes. Once a block's tokens are known and
its keys computed, it is registered under its hash. When its last holder lets go it is not wiped: it
joins an LRU pool of free-but-reusable blocks, tail blocks of a request first, and is evicted only when
no never-cached block is free. An admitted request takes its longest cached prefix, always leaving at
least its last prompt token to compute (its logits are needed) — whole blocks only, so no request ever
writes into a block another one reads.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from strategies.runtime.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, num_slots: int, max_blocks_per_seq: int,
                 prefix_caching: bool = False) -> None:
        if tokens_per_block <= 0 or num_blocks <= 0:
            raise ValueError("tokens_per_block and total_blocks must be positive")
        self.tokens_per_block = tokens_per_block
        self.total_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.table = np.zeros((num_slots, max_blocks_per_seq), dtype=np.int64)  # [S, MB] each slot's blocks
        self._held = [0] * num_slots  # blocks in each slot's table row
        self._hashed = [0] * num_slots  # leading blocks of the row registered in the cache
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # never cached, or wiped
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody; oldest first
        self._by_hash: dict[int, int] = {}  # hash → block
        self._hash_of: dict[int, int] = {}  # block → hash
        self.evictions = 0  # cached blocks wiped to make room

    # --- counts ----------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def blocks_in_use(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def cached_free_blocks(self) -> int:
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def held(self, slot: int) -> int:
        return self._held[slot]

    # --- prefix cache ----------------------------------------------------------------------------
    def block_hashes(self, r: Request, n: int) -> list[int]:
        """The first ``n`` chained block hashes of ``r``'s known tokens, kept on the request."""
        tpb, hashes, tokens = self.tokens_per_block, r.block_hashes, r.token_ids
        while len(hashes) < n:
            b = len(hashes)
            hashes.append(hash((hashes[-1] if b else 0, tokens[b * tpb:(b + 1) * tpb].tobytes())))
        return hashes

    def prefix_hit(self, r: Request) -> list[int]:
        """The cached blocks ``r`` may reuse: its longest cached prefix, less at least one token."""
        if not self.prefix_caching:
            return []
        hits = []
        for h in self.block_hashes(r, (len(r.token_ids) - 1) // self.tokens_per_block):
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_blocks(self, hits: list[int], reserve_tokens: int) -> int:
        """Free blocks an admission consumes: the new ones, and the hits that sat in the LRU pool."""
        return max(0, self.blocks_for(reserve_tokens) - len(hits)) + sum(1 for b in hits if b in self._evictable)

    # --- holding blocks --------------------------------------------------------------------------
    def admit(self, slot: int, hits: list[int], reserve_tokens: int) -> None:
        """Give an empty slot its cached prefix blocks, then grow it to ``reserve_tokens``."""
        if self._held[slot]:
            raise RuntimeError(f"slot {slot} still holds {self._held[slot]} blocks")
        for b in hits:
            self._take(b)
        self.table[slot, :len(hits)] = hits
        self._held[slot] = self._hashed[slot] = len(hits)
        self.grow(slot, reserve_tokens)

    def extra_blocks(self, slot: int, num_tokens: int) -> int:
        """Blocks still to take so that ``slot`` can hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - self._held[slot])

    def can_grow(self, slot: int, num_tokens: int) -> bool:
        return self.extra_blocks(slot, num_tokens) <= self.free_blocks

    def grow(self, slot: int, num_tokens: int) -> None:
        extra = self.extra_blocks(slot, num_tokens)
        if extra > self.free_blocks:
            raise RuntimeError(f"KV cache: slot {slot} needs {extra} more blocks, {self.free_blocks} free")
        n = self._held[slot]
        if n + extra > self.table.shape[1]:
            raise RuntimeError(f"KV cache: slot {slot} would hold {n + extra} blocks, a row has "
                               f"{self.table.shape[1]}")
        for i in range(n, n + extra):
            self.table[slot, i] = self._allocate()
        self._held[slot] = n + extra

    def commit(self, slot: int, r: Request) -> None:
        """Register the slot's blocks that are now full of known tokens with computed keys. Keys are
        launched in stream order, so a later reader always runs after the writer."""
        if not self.prefix_caching:
            return
        full = min(r.num_computed_tokens, len(r.token_ids)) // self.tokens_per_block
        if full <= self._hashed[slot]:
            return
        hashes = self.block_hashes(r, full)
        for i in range(self._hashed[slot], full):
            block = int(self.table[slot, i])
            if hashes[i] not in self._by_hash and block not in self._hash_of:
                self._by_hash[hashes[i]] = block
                self._hash_of[block] = hashes[i]
        self._hashed[slot] = full

    def release(self, slot: int, r: Request) -> None:
        """Let go of every block of the slot; cached ones stay reusable, tail blocks evicted first."""
        self.commit(slot, r)
        for i in range(self._held[slot] - 1, -1, -1):
            b = int(self.table[slot, i])
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        self._held[slot] = self._hashed[slot] = 0

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently released cached block
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self.evictions += 1
        self._ref[block] = 1
        return block
