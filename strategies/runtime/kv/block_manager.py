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

Beam search: a slot has ``max_beam`` table rows (``tables [slots, max_beam, max_blocks_per_seq]``). The
prompt's full blocks are written once, by beam 0's context step, and every beam's row lists them (held
once, by the request). From the block holding the first generated position on, each beam holds blocks
of its own and writes only its own positions; which beam's block a position is read from is the cache
indirection's business (``decoder/beam_search.py``), so a reorder moves no KV and no block.

A host tier (``host_tier.py``, ``--kv-offload-blocks``) extends the cache: a cached block the pool evicts is
copied to host memory first, and the hash chain continues there. A hit is then a GPU block id, or, for a
block the host tier holds, ``~host_block`` (negative): ``admit`` gives it a fresh GPU block and the step
copies its keys back.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strategies.runtime.kv.free_blocks import FreeBlocks
from strategies.runtime.kv.host_tier import HostTier
from strategies.runtime.request import Request


def beam_blocks(num_tokens: int, tokens_per_block: int, width: int, prompt_len: int, held: int = 0) -> int:
    """Blocks a request of ``width`` beams takes to hold ``num_tokens`` tokens when it holds ``held``
    (beam 0's count): beam 0's new ones, plus each other beam's own from its first generated block on."""
    need = -(-num_tokens // tokens_per_block)
    extra = max(0, need - held)
    if width > 1:
        extra += (width - 1) * max(0, need - max(held, prompt_len // tokens_per_block))
    return extra


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, num_slots: int, max_blocks_per_seq: int,
                 prefix_caching: bool = False, max_beam: int = 1, host_blocks: int = 0) -> None:
        if tokens_per_block <= 0 or num_blocks <= 0:
            raise ValueError("tokens_per_block and total_blocks must be positive")
        self.tokens_per_block = tokens_per_block
        self.total_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.tables = np.zeros((num_slots, max_beam, max_blocks_per_seq), dtype=np.int64)  # [S, Kb, MB]
        self.table = self.tables[:, 0]  # [S, MB] each slot's (beam 0's) blocks
        # [S] blocks in each slot's table row: an array, as the scheduler reads it over all decode rows at once
        self.held_blocks = np.zeros(num_slots, dtype=np.int64)
        self._width = [1] * num_slots  # beam rows of the slot's request
        self._shared = [0] * num_slots  # leading blocks every beam of the slot reads (the prompt's full ones)
        self._hashed = np.zeros(num_slots, dtype=np.int64)  # [S] leading blocks of the row registered in the cache
        self._ref = np.zeros(num_blocks, dtype=np.int64)  # [N] holders of each block
        self._free = FreeBlocks(num_blocks)  # never cached, or wiped
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody; oldest first
        self._by_hash: dict[int, int] = {}  # hash → block
        self._hash_of: dict[int, int] = {}  # block → hash
        self.evictions = 0  # cached blocks wiped to make room
        self.host = HostTier(host_blocks) if host_blocks else None  # the host tier, where evicted blocks go

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
        return int(self.held_blocks[slot])

    # --- prefix cache ----------------------------------------------------------------------------
    def block_hashes(self, r: Request, n: int) -> list[int]:
        """The first ``n`` chained block hashes of ``r``'s known tokens, kept on the request."""
        tpb, hashes = self.tokens_per_block, r.block_hashes
        b = len(hashes)
        if b < n:  # the new blocks' bytes in one read, then sliced per block (a numpy view each cost more)
            tokens = r.token_ids
            size = tpb * tokens.itemsize
            data, h = tokens[b * tpb:n * tpb].tobytes(), hashes[-1] if b else 0
            for i in range(0, (n - b) * size, size):
                h = hash((h, data[i:i + size]))
                hashes.append(h)
        return hashes

    def prefix_hit(self, r: Request) -> list[int]:
        """The cached blocks ``r`` may reuse: its longest cached prefix, less at least one token — each a GPU
        block, or ``~host_block`` where only the host tier holds it."""
        if not self.prefix_caching:
            return []
        hits, host = [], self.host
        for h in self.block_hashes(r, (len(r.token_ids) - 1) // self.tokens_per_block):
            block = self._by_hash.get(h)
            if block is None:
                held = host.lookup(h) if host is not None else None
                if held is None:
                    break
                block = ~held
            hits.append(block)
        return hits

    def admission_blocks(self, hits: list[int], reserve_tokens: int, r: Request | None = None) -> int:
        """Free blocks an admission consumes: the new ones (each beam's own too, for a beam request ``r``),
        the hits that sat in the LRU pool, and a fresh one for each hit the host tier holds."""
        width, prompt_len = (r.width, r.prompt_len) if r is not None else (1, 0)
        if not hits and width == 1:  # most admissions
            return -(-reserve_tokens // self.tokens_per_block)
        extra = beam_blocks(reserve_tokens, self.tokens_per_block, width, prompt_len, len(hits))
        return extra + sum(1 for b in hits if b < 0 or b in self._evictable)

    # --- holding blocks --------------------------------------------------------------------------
    def admit(self, slot: int, hits: list[int], reserve_tokens: int, width: int = 1, prompt_len: int = 0,
              hashes: list[int] | None = None) -> None:
        """Give an empty slot its cached prefix blocks, then grow it to ``reserve_tokens``; a beam request
        (``width`` > 1) shares the full blocks of its ``prompt_len`` prompt among its beams. A hit in the host
        tier (``~host_block``; ``hashes``: the request's chain) is onloaded into a fresh block, registered here."""
        if self.held_blocks.item(slot):
            raise RuntimeError(f"slot {slot} still holds {self.held_blocks[slot]} blocks")
        if width > self.tables.shape[1]:
            raise RuntimeError(f"beam width {width} exceeds the tables' {self.tables.shape[1]} rows")
        if hits:  # (an array write even of nothing costs a microsecond; most admissions have no hits)
            ref = self._ref
            for b in hits:
                if b >= 0:
                    holders = ref.item(b)  # (as an int: a numpy scalar's += costs more)
                    if holders == 0:  # it sat in the LRU pool
                        del self._evictable[b]
                    ref[b] = holders + 1
            if min(hits) < 0:  # (after the GPU hits are held: an onload's block never evicts one)
                hits = self._onload(hits, hashes)
            self.tables[slot, :width, :len(hits)] = hits
            self.held_blocks[slot] = self._hashed[slot] = len(hits)  # (else both 0 already: _hashed <= held)
        self._width[slot] = width
        self._shared[slot] = prompt_len // self.tokens_per_block if width > 1 else 0
        self.grow(slot, reserve_tokens)

    def _onload(self, hits: list[int], hashes: list[int] | None) -> list[int]:
        """``hits`` with each host-tier hit replaced by a fresh GPU block its keys are copied into."""
        assert self.host is not None and hashes is not None, "a host-tier hit needs the tier and the chain"
        out, host = list(hits), self.host
        host.keep([~b for b in hits if b < 0])  # (an offload the allocations below make never overwrites them)
        for i, b in enumerate(hits):
            if b < 0:
                h, block = hashes[i], int(self._allocate(1)[0])
                host.load(h, block)
                self._by_hash[h], self._hash_of[block] = block, h
                out[i] = block
        return out

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies for the step being launched: (offloads, onloads), both empty without a tier."""
        return self.host.take_copies() if self.host is not None else ([], [])

    def extra_blocks(self, slot: int, num_tokens: int) -> int:
        """Blocks still to take so that ``slot`` can hold ``num_tokens`` tokens (in every beam)."""
        shared_tokens = self._shared[slot] * self.tokens_per_block
        return beam_blocks(num_tokens, self.tokens_per_block, self._width[slot], shared_tokens, self.held_blocks[slot])

    def can_grow(self, slot: int, num_tokens: int) -> bool:
        return self.extra_blocks(slot, num_tokens) <= self.free_blocks

    def allocate(self, slot: int, num_tokens: int) -> list[int] | None:
        """vLLM's ``allocate_slots``: blocks so that ``slot`` holds ``num_tokens`` tokens — the ones it newly took
        (none if it held them already) — or None, nothing taken, when the pool has too few (the scheduler then
        preempts and asks again)."""
        held = self.held_blocks.item(slot)
        if -(-num_tokens // self.tokens_per_block) <= held:  # (the common decode step: nothing to take)
            return []
        if not self.can_grow(slot, num_tokens):
            return None
        self.grow(slot, num_tokens)
        return self.table[slot, held:self.held_blocks.item(slot)].tolist()

    def grow(self, slot: int, num_tokens: int) -> None:
        n, need = self.held_blocks.item(slot), -(-num_tokens // self.tokens_per_block)
        if need <= n:  # every beam already holds the blocks (the common decode step)
            return
        width = self._width[slot]
        extra = need - n if width == 1 else self.extra_blocks(slot, num_tokens)
        if extra > len(self._free) + len(self._evictable):
            raise RuntimeError(f"KV cache: slot {slot} needs {extra} more blocks, {self.free_blocks} free")
        if need > self.table.shape[1]:
            raise RuntimeError(f"KV cache: slot {slot} would hold {need} blocks, a row has {self.table.shape[1]}")
        self.table[slot, n:need] = self._allocate(need - n)
        if width > 1:
            rows, shared = self.tables[slot], self._shared[slot]  # [Kb, MB]
            own = min(max(n, shared), need)  # beams > 0 list the shared prompt blocks, then hold their own
            for b in range(1, width):
                rows[b, n:own] = rows[0, n:own]
                if need > own:
                    rows[b, own:need] = self._allocate(need - own)
        self.held_blocks[slot] = need

    def uncommitted(self, slots: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """Indices into ``slots`` [N] whose computed tokens ``computed`` [N] have filled a block since their last
        commit: the rows ``commit`` has work for (one array test a step, where a call per running request was)."""
        return (computed // self.tokens_per_block > self._hashed[slots]).nonzero()[0]

    def commit(self, slot: int, r: Request) -> None:
        """Register the slot's blocks that are now full of known tokens with computed keys. Keys are
        launched in stream order, so a later reader always runs after the writer."""
        if not self.prefix_caching:
            return
        computed = r.num_computed_tokens
        if computed // self.tokens_per_block <= self._hashed[slot]:  # no block filled since (most steps)
            return
        # A beam request's known tokens end with its prompt: beam 0's blocks after it hold a beam's keys.
        known = r.prompt_len if r.width > 1 else len(r.token_ids)
        full = min(computed, known) // self.tokens_per_block
        if full <= self._hashed[slot]:
            return
        hashes, first = self.block_hashes(r, full), self._hashed[slot]
        for h, block in zip(hashes[first:full], self.table[slot, first:full].tolist(), strict=True):
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
        self._hashed[slot] = full

    def release(self, slot: int, r: Request) -> None:
        """Let go of every block of the slot; cached ones stay reusable, tail blocks evicted first."""
        self.commit(slot, r)
        held, shared = int(self.held_blocks[slot]), self._shared[slot]
        if not self._hash_of and self._width[slot] == 1:  # nothing cached, so nothing shared: each block is
            blocks = self.table[slot, :held][::-1]  # [held] this slot's alone (ref 1); tail blocks first
            self._free.put(blocks)
            self._ref[blocks] = 0
        else:
            ref = self._ref
            for beam in range(self._width[slot] - 1, 0, -1):  # beams' own blocks: never cached
                own = self.tables[slot, beam, shared:held]  # [held - shared]
                self._free.put(own)
                ref[own] = 0
            freed = []  # (queued in one call: a call a block cost ~1.3 us each)
            for b in self.table[slot, :held][::-1].tolist():  # tail blocks first
                holders = ref.item(b) - 1
                ref[b] = holders
                if holders == 0:
                    if b in self._hash_of:
                        self._evictable[b] = None
                    else:
                        freed.append(b)
            if freed:
                self._free.put(freed)
        self.held_blocks[slot] = self._hashed[slot] = 0
        self._width[slot], self._shared[slot] = 1, 0

    def trim(self, slot: int, num_tokens: int) -> None:
        """Give back a one-row slot's blocks past ``num_tokens``: speculative decoding's rejected positions
        (never registered in the prefix cache: only blocks of tokens the host knows are)."""
        keep, held = self.blocks_for(num_tokens), int(self.held_blocks[slot])
        for i in range(keep, held):
            b = int(self.table[slot, i])
            assert b not in self._hash_of, "a block past the computed tokens is never cached"
            self._ref[b] -= 1
            if self._ref.item(b) == 0:
                self._free.put((b,))
        self.held_blocks[slot] = min(keep, held)

    def _allocate(self, count: int) -> np.ndarray:
        """[count] blocks, never-cached ones first, then the least recently released cached ones."""
        free = self._free
        blocks = free.take(min(count, len(free)))
        if len(blocks) < count:
            evicted = []
            for _ in range(count - len(blocks)):  # evict the least recently released cached block
                block, _ = self._evictable.popitem(last=False)
                h = self._hash_of.pop(block)
                del self._by_hash[h]
                if self.host is not None:  # its keys go to the host tier before the block is reused
                    self.host.store(h, block)
                self.evictions += 1
                evicted.append(block)
            blocks = np.concatenate((blocks, np.array(evicted, dtype=np.int64)))
        self._ref[blocks] = 1
        return blocks
