"""KV cache storage: one pool of pages per layer, allocated once at the size ``--kv-blocks`` names.

A page is one token's key (or value) for every KV head. ``tokens_per_block`` consecutive pages form a
block, the unit the block manager hands out; a request's keys live in whatever blocks its block-table
row lists, in order. The pool is head-major, ``[layers, kv_heads, blocks * tokens_per_block, head_dim]``:
gathering a batch's pages with ``index_select`` then yields ``[kv_heads, batch, positions, head_dim]``,
which attention consumes without a transpose copy (measured against ``[blocks, kv_heads, tokens, dim]``
in ``tests/benchmarks/test_micro.py::test_decode_attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from strategies.runtime.buffers.memory import DeviceMemory


class KVCachePool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, tokens_per_block: int, memory: DeviceMemory) -> None:
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, num_blocks * tokens_per_block, cfg.head_dim)
        self.k = memory.zeros(shape, cfg.torch_dtype)  # [L, Hkv, blocks * tokens_per_block, D]
        self.v = memory.zeros(shape, cfg.torch_dtype)  # [L, Hkv, blocks * tokens_per_block, D]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def gather_blocks(dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor) -> None:
    """Pool blocks ``blocks [n]`` of ``k``, ``v`` ``[L, Hkv, N * T, D]`` into ``dst[:n]`` ``[n, 2, L, Hkv, T, D]``:
    one device kernel per pool, from the layer-major pool into contiguous blocks (a transfer's staging)."""
    n, t = len(blocks), dst.shape[4]
    for i, pool in enumerate((k, v)):
        dst[:n, i] = pool.unflatten(2, (-1, t)).index_select(2, blocks).movedim(2, 0)  # [n, L, Hkv, T, D]


def scatter_blocks(src: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor) -> None:
    """The twin of ``gather_blocks``: ``src[:n]`` into pool blocks ``blocks [n]``."""
    n, t = len(blocks), src.shape[4]
    for i, pool in enumerate((k, v)):
        pool.unflatten(2, (-1, t)).index_copy_(2, blocks, src[:n, i].movedim(0, 2))  # [L, Hkv, n, T, D]
