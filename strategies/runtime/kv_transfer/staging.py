"""The KV staging buffer: where a request's KV blocks wait between a context engine's pool and a generation
engine's (TensorRT-LLM's ``CacheTransBufferManager``; SGLang and vLLM's NIXL connectors register the pools
themselves instead).

Each engine of a disaggregated deployment owns one, sized by ``--kv-transfer-buffer-mb``. A send gathers up
to ``capacity`` blocks of the pool into it on the device and downloads them to its host half; the link
delivers the host half to the receiving engine's host half; a receive uploads them and scatters them into
that engine's blocks. Every copy is one contiguous prefix issued on the engine's stream, so the same code
runs on CUDA (pinned host halves, asynchronous copies), on CPU split memory and in a CPU device process.
"""

from __future__ import annotations

import torch

from strategies.runtime.buffers.memory import DeviceMemory, Mirrored
from strategies.runtime.models.config import ModelConfig


def block_bytes(cfg: ModelConfig, tokens_per_block: int) -> int:
    """Bytes of one KV block: keys and values of every layer and KV head."""
    itemsize = torch.empty((), dtype=cfg.torch_dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * tokens_per_block * cfg.head_dim * itemsize


class KVStaging:
    def __init__(self, cfg: ModelConfig, capacity: int, tokens_per_block: int, memory: DeviceMemory) -> None:
        self.capacity = capacity  # blocks one chunk moves
        self.memory = memory
        self.blocks = Mirrored(memory, (capacity,), torch.int64)  # [C] pool block of each staged block
        shape = (capacity, 2, cfg.num_hidden_layers, cfg.num_key_value_heads, tokens_per_block, cfg.head_dim)
        # no numpy view (Mirrored's): numpy has no bfloat16, and the host only ever copies it whole
        self.host = memory.host(shape, cfg.torch_dtype)  # [C, 2 (k, v), L, Hkv, T, D]
        self.dev = memory.mirror(self.host)  # [C, 2, L, Hkv, T, D]

    def gather(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Device side of a send: blocks ``blocks[:n]`` of the pools ``[L, Hkv, N * T, D]`` into the buffer,
        then to its host half."""
        self.blocks.upload(n)
        b = self.blocks.dev[:n]  # [n]
        t = self.host.shape[4]
        for i, pool in enumerate((k, v)):
            self.dev[:n, i] = pool.unflatten(2, (-1, t)).index_select(2, b).movedim(2, 0)  # [n, L, Hkv, T, D]
        self.memory.download(self.host, self.dev, n)

    def scatter(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Device side of a receive: the host half's first ``n`` blocks into blocks ``blocks[:n]`` of the pools."""
        self.blocks.upload(n)
        self.memory.upload(self.dev, self.host, n)
        b = self.blocks.dev[:n]  # [n]
        t = self.host.shape[4]
        for i, pool in enumerate((k, v)):
            pool.unflatten(2, (-1, t)).index_copy_(2, b, self.dev[:n, i].movedim(0, 2))  # [L, Hkv, n, T, D]
