"""The host KV tier's storage, and the device piece that moves blocks between it and the GPU pool.

``host [H, 2 (k, v), L, Hkv, T, D]``: a block's keys and values for every layer, contiguous, in host memory —
pinned on CUDA, so that each block's copy is one asynchronous DMA (TensorRT-LLM's secondary pool is pinned
too; vLLM's CPU tier is, where pinning is available). The GPU pool is layer-major (``pool.py``), so a block
there is strided: the piece gathers up to ``CHUNK`` blocks into a contiguous device staging buffer with one
kernel, then copies each to its host block (offload); an onload copies host blocks into the staging buffer,
then scatters them into their GPU blocks. Offloads run first: an onload may fill a block whose old keys are
leaving this same step.

The piece runs on the engine's stream ahead of the step's forward, so every copy is ordered after the steps
before it (which may still write an evicted block's last keys) and before this step's reads and writes.
TensorRT-LLM issues the same copies on copy streams of their own, but only after syncing them with the compute
stream, and makes the step's kernels wait for them: the same order. The simulated device prices them on a copy
engine with that order (``sim/device.py``). The same code runs on CUDA, on the CPU device (shared or
split memory) and in a CPU device process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.runtime.kv.pool import gather_blocks, scatter_blocks
from strategies.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from strategies.runtime.buffers.kv_copies import KVCopies
    from strategies.runtime.buffers.memory import DeviceMemory

CHUNK = 16  # blocks the device staging buffer holds: a copy of more goes chunk by chunk


class KVHostPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, tokens_per_block: int, memory: DeviceMemory) -> None:
        block = (2, cfg.num_hidden_layers, cfg.num_key_value_heads, tokens_per_block, cfg.head_dim)
        self.memory = memory
        self.host = memory.host((num_blocks, *block), cfg.dtype)  # [H, 2, L, Hkv, T, D]
        self.staging = memory.zeros((CHUNK, *block), cfg.dtype)  # [CHUNK, 2, L, Hkv, T, D] device only

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def copy(self, lists: KVCopies, k: torch.Tensor, v: torch.Tensor) -> None:
        """Device piece: the step's offloads (GPU pool → host tier), then its onloads (host tier → GPU pool)."""
        lists.upload_lists()
        n, m = lists.num_offload, lists.num_onload
        # (host blocks from the lists' host half: they index host memory)
        self.move(lists.offload.dev[:n, 0], lists.offload.np[:n, 1].tolist(), lists.onload.np[:m, 0].tolist(),
                  lists.onload.dev[:m, 1], k, v)

    def move(self, out_gpu: torch.Tensor, out_host: list[int], in_host: list[int], in_gpu: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
        """GPU blocks ``out_gpu`` [n] into host blocks ``out_host``, then host blocks ``in_host`` into GPU blocks
        ``in_gpu`` [m], chunk by chunk through the staging buffer."""
        memory, staging = self.memory, self.staging
        for start in range(0, len(out_host), CHUNK):
            chunk = out_host[start:start + CHUNK]
            gather_blocks(staging, k, v, out_gpu[start:start + len(chunk)].contiguous())
            for i, h in enumerate(chunk):
                memory.download_row(self.host, h, staging[i])
        for start in range(0, len(in_host), CHUNK):
            chunk = in_host[start:start + CHUNK]
            for i, h in enumerate(chunk):
                memory.upload_row(staging[i], self.host, h)
            scatter_blocks(staging, k, v, in_gpu[start:start + len(chunk)].contiguous())
