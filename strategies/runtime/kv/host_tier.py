"""The host KV tier's book: which host block holds which cached block's keys, and the copies a step must make.

A second tier of KV blocks in host memory (TensorRT-LLM's secondary pool, vLLM's CPU offloading, SGLang's
HiCache). It behaves as TensorRT-LLM's does (``kvCacheManager.cpp``: ``getFreeBlock`` offloads on eviction,
``onboardBlock`` at admission):

- **offload on eviction** (write-back): when the GPU pool wipes a cached block to reuse it, the block's keys
  are first copied to a host block, registered there under the same chain hash. A hash the tier holds
  already is only touched: equal hashes mean equal keys, so nothing is copied twice.
- **onload on reuse**: an admission whose prefix continues in the host tier takes fresh GPU blocks for those
  hashes, and the step copies the keys back before its forward reads them.
- **LRU** in this tier as in the GPU's: a hit or a store makes a host block the newest; a store into a full
  tier evicts the oldest, never one this step still reads (an onload's source).

This module only keeps the book. The copies are data the scheduler hands the step (``take_copies``); the
engine makes them (``host_pool.py``), the simulated device prices them over the host link.
"""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"--kv-offload-blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash → host block, oldest first
        self._free = list(range(num_blocks - 1, -1, -1))  # never-used host blocks (popped from the end)
        self._reading: set[int] = set()  # host blocks an onload of the step being scheduled reads
        self.offloads: list[tuple[int, int]] = []  # (GPU block, host block) the next step copies out first
        self.onloads: list[tuple[int, int]] = []  # (host block, GPU block) it copies in, after the offloads
        self.offloaded_blocks = 0  # totals over the run, each way
        self.onloaded_blocks = 0
        self.dropped_blocks = 0  # evicted from the GPU pool with no host block to take them (all being read)

    @property
    def used_blocks(self) -> int:
        return len(self._lru)

    def lookup(self, h: int) -> int | None:
        """The host block holding hash ``h``, or None."""
        return self._lru.get(h)

    def store(self, h: int, gpu_block: int) -> None:
        """The GPU pool evicts ``gpu_block`` (hash ``h``): copy its keys to a host block, unless held already."""
        if h in self._lru:
            self._lru.move_to_end(h)
            return
        if self._free:
            host = self._free.pop()
        else:
            victim = next((k for k, b in self._lru.items() if b not in self._reading), None)
            if victim is None:  # every host block is an onload's source this step: the keys are lost
                self.dropped_blocks += 1
                return
            host = self._lru.pop(victim)
        self._lru[h] = host
        self.offloads.append((gpu_block, host))
        self.offloaded_blocks += 1

    def keep(self, host_blocks: list[int]) -> None:
        """Hold ``host_blocks`` for this step's onloads: no store evicts them before the step's copies run."""
        self._reading.update(host_blocks)

    def load(self, h: int, gpu_block: int) -> None:
        """Hash ``h``'s keys into ``gpu_block`` before the step reads them; its host block stays (and is newest)."""
        host = self._lru[h]
        self._lru.move_to_end(h)
        self._reading.add(host)
        self.onloads.append((host, gpu_block))
        self.onloaded_blocks += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the step being launched makes — (offloads, onloads), offloads first, as recorded — and a
        clean sheet for the next."""
        out = (self.offloads, self.onloads)
        self.offloads, self.onloads = [], []
        self._reading.clear()
        return out
