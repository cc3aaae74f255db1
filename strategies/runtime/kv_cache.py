"""KV cache: preallocated storage per slot, and block accounting for admission.

Storage is contiguous per slot and head (``[layers, slots, kv_heads, max_seq_len, head_dim]``), so a
slot's keys are a matmul-ready view and attention never gathers pages. Capacity is governed separately
by the block manager, as a paged cache would be: ``total_blocks`` of ``tokens_per_block`` tokens may be
smaller than slots × max_seq_len, which is how a run is given a tight cache and how schedulers decide
admission and preemption.
"""

from __future__ import annotations

import torch

from strategies.runtime.model import ModelConfig


class KVCacheStorage:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_seq_len: int, device: torch.device) -> None:
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)  # [L, S, Hkv, max_seq, D]
        self.v = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)  # [L, S, Hkv, max_seq, D]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KVCacheManager:
    """Block accounting. A request holds ceil(tokens / tokens_per_block) blocks while it runs."""

    def __init__(self, tokens_per_block: int, total_blocks: int) -> None:
        if tokens_per_block <= 0 or total_blocks <= 0:
            raise ValueError("tokens_per_block and total_blocks must be positive")
        self.tokens_per_block = tokens_per_block
        self.total_blocks = total_blocks
        self._held: dict[str, int] = {}
        self.blocks_in_use = 0

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.blocks_in_use

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def held(self, owner: str) -> int:
        return self._held.get(owner, 0)

    def extra_blocks(self, owner: str, num_tokens: int) -> int:
        """Blocks still to take so that ``owner`` can hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - self.held(owner))

    def can_grow(self, owner: str, num_tokens: int) -> bool:
        return self.extra_blocks(owner, num_tokens) <= self.free_blocks

    def grow(self, owner: str, num_tokens: int) -> None:
        extra = self.extra_blocks(owner, num_tokens)
        if extra > self.free_blocks:
            raise RuntimeError(f"KV cache: {owner!r} needs {extra} more blocks, {self.free_blocks} free")
        if extra:
            self._held[owner] = self.held(owner) + extra
            self.blocks_in_use += extra

    def free(self, owner: str) -> None:
        self.blocks_in_use -= self._held.pop(owner, 0)
