"""A host staging buffer, its device twin, and the numpy view the host fills — on any device's memory.

The buffers every engine builds (runtime buffers, step inputs and outputs, draft tokens, encoder buffers,
the KV staging buffer's block list) are made of these. They ask their memory for tensors by dtype *name*
(``"int64"``, ``"float32"``, or a model's ``"bfloat16"``), so this module and theirs import no torch: the
same buffer code runs on a device's torch memory (``memory.py``: CUDA, the CPU device, split or shared) and
on the simulated device's numpy memory (``buffers/sim_memory.py``), where a run never imports torch.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

MEMORY_MODES = ("shared", "split")


class Memory(Protocol):
    """What a buffer asks of a device's memory (``DeviceMemory``, ``SimMemory``)."""

    def host(self, shape: tuple[int, ...], dtype: Any) -> Any: ...  # a staging buffer (pinned on CUDA)

    def zeros(self, shape: tuple[int, ...], dtype: Any, fill: float = 0) -> Any: ...  # device-only

    def mirror(self, host: Any) -> Any: ...  # a staging buffer's device twin (itself when shared)

    def numpy(self, host: Any) -> np.ndarray: ...  # a staging buffer's numpy view (same memory)

    def upload(self, dev: Any, host: Any, n: int) -> None: ...  # rows [0, n) host -> device

    def download(self, host: Any, dev: Any, n: int) -> None: ...  # rows [0, n) device -> host

    def place(self, module: Any) -> Any: ...  # the device's copy of a model's weights


class Mirrored:
    """A host staging tensor, its device twin, and a numpy view for the host to fill without torch ops.

    The host writes rows [0, n) and the device stream uploads them; or the device writes and the stream
    downloads them for the host to read once the step is waited for. Dim 0 is the one that grows, so a
    prefix is always one contiguous region.
    """

    def __init__(self, memory: Memory, shape: tuple[int, ...], dtype: str) -> None:
        self.memory = memory
        self.host = memory.host(shape, dtype)
        self.dev = memory.mirror(self.host)
        self.np: np.ndarray = memory.numpy(self.host)

    def upload(self, n: int) -> None:
        self.memory.upload(self.dev, self.host, n)

    def download(self, n: int) -> None:
        self.memory.download(self.host, self.dev, n)
