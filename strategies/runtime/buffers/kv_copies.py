"""The host KV tier's copy lists: which blocks one step moves between the GPU pool and the host tier.

Host → device: the step's offloads, ``[n, 2]`` (GPU block, host block) — cached blocks the GPU pool evicted
this schedule, copied out before anything overwrites them — and its onloads, ``[m, 2]`` (host block, GPU
block) — prefix hits the host tier held, copied into fresh GPU blocks before the forward reads them. The
scheduler writes them into the batch (``BlockManager.take_copies``); this family stages them, one set per
buffer set like the step's other inputs, so a step in flight keeps its lists while the host fills the next.
The copy piece (``kv/host_pool.py``), not the forward, uploads them: it runs first. TensorRT-LLM keeps the
same lists in its ``KVCacheTransferManager`` (offload, onboard), vLLM's offloading connector in its
``TransferSpec`` (src, dst) pairs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.runtime.buffers.family import EngineSizes, StepFill
from strategies.runtime.buffers.mirrored import Memory, Mirrored

if TYPE_CHECKING:
    from strategies.runtime.models.config import ModelConfig


class KVCopies:
    name = "kv_copies"  # a buffer family (buffers/family.py)
    HOST_STATE = ("num_offload", "num_onload")

    def __init__(self, capacity: int, memory: Memory) -> None:
        self.capacity = capacity
        self.offload = Mirrored(memory, (capacity, 2), "int64")  # [C, 2] (GPU block, host block)
        self.onload = Mirrored(memory, (capacity, 2), "int64")  # [C, 2] (host block, GPU block)
        self.num_offload = self.num_onload = 0

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: EngineSizes, memory: Memory, shared: dict) -> KVCopies | None:
        if not sizes.kv_offload_blocks:
            return None
        # A step onloads at most a block per GPU block; it evicts a block twice only when a preemption gave it
        # back within the same schedule
        return cls(2 * sizes.num_blocks, memory)

    def fill_step(self, f: StepFill) -> None:
        for pairs, m, count in ((f.batch.kv_offload, self.offload, "num_offload"),
                                (f.batch.kv_onload, self.onload, "num_onload")):
            if len(pairs) > self.capacity:
                raise RuntimeError(f"host KV tier: {len(pairs)} copies in one step, the lists hold {self.capacity}")
            if pairs:
                m.np[:len(pairs)] = pairs
            setattr(self, count, len(pairs))

    @property
    def any(self) -> bool:
        return bool(self.num_offload or self.num_onload)

    def upload(self) -> None:
        """Nothing in the forward: the copy piece, which runs before it, uploads the lists (``upload_lists``)."""

    def upload_lists(self) -> None:
        self.offload.upload(self.num_offload)
        self.onload.upload(self.num_onload)

    def download(self) -> None:
        """Nothing comes back: a copy's completion is its step's."""
