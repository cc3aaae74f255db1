"""The KV staging buffer: where a request's KV blocks wait between a context engine's pool and a generation
engine's (TensorRT-LLM's ``CacheTransBufferManager``; SGLang and vLLM's NIXL connectors register the pools
themselves instead).

Each engine of a disaggregated deployment owns one, sized by ``--kv-transfer-buffer-mb``. A send gathers up
to ``capacity`` blocks of the pool into it on the device; a receive scatters them into the receiving
engine's blocks. Between the two, the link:

- device processes (the CPU device's default): a gloo group among them (``gloo_link.py``); the blocks go
  from the sender's buffer to the receiver's, never through the host;
- one process (the CPU device thread, a CUDA stream): the sender downloads to its host half (pinned on CUDA)
  on its stream, and once that piece is done the receiver uploads from the *sender's* host half on its own
  stream: two asynchronous copies ordered by the host's query of the send, no copy on the host's loop.

Every copy is one contiguous prefix issued on the engine's stream, so the same code runs on CUDA (pinned
host halves, asynchronous copies), on CPU split memory and in a CPU device process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.runtime.buffers.mirrored import Memory, Mirrored
from strategies.runtime.kv.pool import gather_blocks, scatter_blocks
from strategies.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from strategies.runtime.kv_transfer.gloo_link import GlooLink


def block_bytes(cfg: ModelConfig, tokens_per_block: int) -> int:
    """Bytes of one KV block: keys and values of every layer and KV head."""
    return cfg.kv_bytes_per_token * tokens_per_block


class KVStaging:
    def __init__(self, cfg: ModelConfig, capacity: int, tokens_per_block: int, memory: Memory) -> None:
        self.capacity = capacity  # blocks one chunk moves
        self.memory = memory
        self.blocks = Mirrored(memory, (capacity,), "int64")  # [C] pool block of each staged block
        shape = (capacity, 2, cfg.num_hidden_layers, cfg.num_key_value_heads, tokens_per_block, cfg.head_dim)
        # no numpy view (Mirrored's): numpy has no bfloat16, and the host only ever copies it whole
        self.host = memory.host(shape, cfg.dtype)  # [C, 2 (k, v), L, Hkv, T, D]
        self.dev = memory.mirror(self.host)  # [C, 2, L, Hkv, T, D]

        self.received = Mirrored(memory, (1,), "int64")  # [1] 1: the last receive's blocks arrived
        self.link: GlooLink | None = None  # device processes: this engine's end of the link (gloo_link.py)

    def send(self, n: int, k: torch.Tensor, v: torch.Tensor, peer: int | None) -> None:
        """Device side of a send: blocks ``blocks[:n]`` of the pools into the buffer, then posted to rank
        ``peer`` of the link, or (``peer`` None) downloaded to the host half for the host to relay."""
        if peer is None:
            self.gather(n, k, v)
            self.memory.download(self.host, self.dev, n)
            return
        assert self.link is not None, "a send to a rank needs the link"
        self.link.settle()  # the previous chunk has left the buffer
        self.gather(n, k, v)
        self.link.send(self.dev[:n], peer)

    def receive(self, n: int, k: torch.Tensor, v: torch.Tensor, peer: int | None,
                source: torch.Tensor | None = None) -> None:
        """Device side of a receive: rank ``peer``'s posted blocks (or, ``peer`` None, the sender's host half
        ``source``, its send done) into the buffer, then into blocks ``blocks[:n]`` of the pools. Blocks that
        never came (the sender left) leave the pools as they were and ``received`` 0, for the host to read."""
        if peer is None:
            assert source is not None, "a relayed receive reads the sender's host half"
            self.memory.upload(self.dev, source, n)
            ok = True
        else:
            assert self.link is not None, "a receive from a rank needs the link"
            ok = self.link.recv(self.dev[:n], peer)
        self.received.dev[0] = int(ok)
        self.received.download(1)
        if ok:
            self.scatter(n, k, v)

    def gather(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks ``blocks[:n]`` of the pools ``[L, Hkv, N * T, D]`` into the buffer's device half."""
        self.blocks.upload(n)
        gather_blocks(self.dev, k, v, self.blocks.dev[:n])

    def scatter(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The buffer's device half's first ``n`` blocks into blocks ``blocks[:n]`` of the pools."""
        self.blocks.upload(n)
        scatter_blocks(self.dev, k, v, self.blocks.dev[:n])
