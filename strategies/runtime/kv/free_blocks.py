"""The KV cache's never-cached free blocks, oldest first: a FIFO of block ids in a ring array.

An admission takes its ~32 blocks and a finish gives back its ~48 at once, so the queue moves whole runs
of ids with a slice or two instead of one ``deque`` call per block (docs/host-path.md). The order is a
deque's: ``take`` hands out the oldest ids, ``put`` queues ids behind the rest in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class FreeBlocks:
    def __init__(self, num_blocks: int) -> None:
        # [N] a block is free at most once, so N places hold every free id; the queue runs from ``_head``
        # for ``_len`` places, wrapping at the end
        self._ring = np.arange(num_blocks, dtype=np.int64)
        self._head = 0
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def take(self, count: int) -> np.ndarray:
        """[count] the oldest ``count`` free blocks, which leave the queue (a new array, never a view)."""
        if count > self._len:
            raise RuntimeError(f"KV cache: {count} blocks asked of {self._len} free")
        ring, head = self._ring, self._head
        end = head + count  # past len(ring): the run wraps to the start
        out = ring[head:end].copy() if end <= len(ring) else np.concatenate((ring[head:], ring[:end - len(ring)]))
        self._head = end % len(ring)
        self._len -= count
        return out

    def put(self, blocks: np.ndarray | Sequence[int]) -> None:
        """Queue ``blocks`` behind the free ones, in their order."""
        ring, n = self._ring, len(blocks)
        if self._len + n > len(ring):
            raise RuntimeError(f"KV cache: {self._len + n} free blocks of {len(ring)}: a block freed twice")
        tail = (self._head + self._len) % len(ring)
        first = min(n, len(ring) - tail)
        ring[tail:tail + first] = blocks[:first]
        ring[:n - first] = blocks[first:]
        self._len += n
