"""Memory of a device that is another process (``device/process.py``): staging buffers in shared memory,
device tensors over there.

Both processes build the same engine with the same sizes, so they allocate in the same order:

- the host's side (``HostSideMemory``): a staging buffer is a file in shared memory (/dev/shm), mapped; a
  device-only tensor (weights, KV pools, decoder state, logits, split mode's mirrors) is a ``meta`` tensor —
  a shape and a dtype, no storage. The tensor itself lives in the device process; host code that tried to
  read it would fail at once instead of reading a stale copy.
- the device's side (``DeviceSideMemory``): maps the same files and hands them out, in order, where the
  engine asks for a staging buffer; allocates its device tensors for real. Shared mode:
  the device reads the staging buffers themselves; split: it keeps twins and copies in stream order, as on
  CUDA — the split-memory model made physical by a process boundary.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

from strategies.runtime.buffers.memory import DeviceMemory, torch_dtype

# Where staging files live: a memory-backed file system where there is one
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
Staging = tuple[str, tuple[int, ...], torch.dtype]  # a staging buffer as the device process maps it


def map_staging(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the file at ``path``, shared with every process that maps it."""
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


class HostSideMemory(DeviceMemory):
    def __init__(self, split: bool) -> None:
        super().__init__(torch.device("cpu"), split)
        self.staging: list[Staging] = []  # every staging buffer, in allocation order (the device maps them)

    def host(self, shape: tuple[int, ...], dtype: torch.dtype | str) -> torch.Tensor:
        dtype = torch_dtype(dtype)
        fd, path = tempfile.mkstemp(prefix="slotbench-staging-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, max(1, torch.Size(shape).numel() * dtype.itemsize))
        finally:
            os.close(fd)
        t = map_staging(path, tuple(shape), dtype)
        self._staging.add(t.untyped_storage().data_ptr())
        self.staging.append((path, tuple(shape), dtype))
        return t

    def unlink(self) -> None:
        """Remove the staging files once the device has mapped them (the mappings stay)."""
        for path, _, _ in self.staging:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype | str, fill: float = 0) -> torch.Tensor:
        return torch.empty(shape, dtype=torch_dtype(dtype), device="meta")  # it lives in the device process

    def mirror(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(host, device="meta") if self.split else host

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the device process loads a copy of its own


class DeviceSideMemory(DeviceMemory):
    def __init__(self, split: bool, staging: list[Staging]) -> None:
        super().__init__(torch.device("cpu"), split)
        self._given = iter(staging)

    def host(self, shape: tuple[int, ...], dtype: torch.dtype | str) -> torch.Tensor:
        dtype = torch_dtype(dtype)
        given = next(self._given, None)
        if given is None or given[1] != tuple(shape) or given[2] != dtype:
            raise RuntimeError(f"device process: the host's staging buffers do not match the engine's "
                               f"(asked {tuple(shape)} {dtype}, got {given and given[1:]})")
        t = map_staging(*given)
        self._staging.add(t.untyped_storage().data_ptr())
        return t

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # already the device's own copy: it came from the host as bytes
