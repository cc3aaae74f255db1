"""Host and device memory on torch: where each tensor lives, and the one routine that moves a prefix between them.

Three arrangements run this same code:

- ``cuda``: host staging buffers are pinned, device tensors live on the GPU, and every transfer is a
  non-blocking copy issued on the device stream.
- ``split`` on CPU (``--device-memory split``): the device owns tensors of its own — weights, KV pools,
  decoder state, runtime buffers, step outputs — distinct from the host's staging buffers, and every
  transfer is a copy issued on the device stream, in order, exactly as on CUDA. This is how CI runs the
  GPU's code path without a GPU: a missing, misplaced or strided copy fails here too.
- ``shared`` on CPU (the CPU default): a host buffer's device mirror is the buffer itself and transfers
  are skipped. One step owns a buffer set from prepare until its outputs are read, so nothing races.

A copy is only ever one contiguous prefix of a staging buffer: PyTorch stages a strided (or pageable)
host↔device copy through a temporary that is not pinned, and such a copy blocks the host until the
device has caught up — overlap would silently stop overlapping. ``upload``/``download`` refuse it.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or a dtype's name as numpy and torch both spell it (the buffers' way, ``mirrored.py``)."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)


class DeviceMemory:
    def __init__(self, device: torch.device, split: bool) -> None:
        if device.type == "cuda" and not split:
            raise ValueError("CUDA device memory is always split from the host's")
        self.device = device
        self.split = split
        self.pinned = device.type == "cuda"  # pinned staging makes H2D/D2H copies asynchronous
        self._staging: set[int] = set()  # storages handed out by host(): the only legal copy ends

    def host(self, shape: tuple[int, ...], dtype: torch.dtype | str) -> torch.Tensor:
        """A host staging buffer (pinned on CUDA)."""
        t = torch.zeros(shape, dtype=torch_dtype(dtype))
        if self.pinned:
            t = t.pin_memory()
        self._staging.add(t.untyped_storage().data_ptr())
        return t

    def share(self, host: torch.Tensor) -> None:
        """Accept another engine's staging buffer as a copy end: a disaggregated receiver uploads from the
        sender's host half (``kv_transfer/staging.py``)."""
        self._staging.add(host.untyped_storage().data_ptr())

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype | str, fill: float = 0) -> torch.Tensor:
        """A device-only tensor (decoder state, KV pools, logits): never seen by the host."""
        return torch.full(shape, fill, dtype=torch_dtype(dtype), device=self.device)

    def mirror(self, host: torch.Tensor) -> torch.Tensor:
        """The device twin of a staging buffer: its own tensor when split, the same one when shared."""
        return torch.zeros_like(host, device=self.device) if self.split else host

    def numpy(self, host: torch.Tensor) -> np.ndarray:
        """A staging buffer's numpy view, for the host to fill and read without torch ops."""
        return host.numpy()

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """The device's own copy of the model's weights (split: a copy on the device, CUDA or CPU alike; the
        caller's module is never moved or changed), or, shared, the host's module itself."""
        return copy.deepcopy(module).to(self.device) if self.split else module

    def upload(self, dev: torch.Tensor, host: torch.Tensor, n: int) -> None:
        """Host → device: rows [0, n) of a staging buffer, issued on the current stream."""
        if dev is not host and n > 0:
            self._copy(dev[:n], host[:n], host)

    def download(self, host: torch.Tensor, dev: torch.Tensor, n: int) -> None:
        """Device → host: rows [0, n) into a staging buffer, issued on the current stream."""
        if dev is not host and n > 0:
            self._copy(host[:n], dev[:n], host)

    def download_row(self, host: torch.Tensor, row: int, dev: torch.Tensor) -> None:
        """Device → host: the contiguous ``dev`` into ``host[row]``, issued on the current stream — always a copy,
        shared memory too (the host KV tier's blocks are a store of their own, not a device buffer's twin)."""
        self._copy(host[row], dev, host)

    def upload_row(self, dev: torch.Tensor, host: torch.Tensor, row: int) -> None:
        """Host → device: ``host[row]`` into the contiguous ``dev``, issued on the current stream."""
        self._copy(dev, host[row], host)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, host: torch.Tensor) -> None:
        # Checked on every copy, on CPU as on CUDA: the same line fails in CI that would block on a GPU.
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise RuntimeError(f"host<->device copy of a strided region {tuple(src.shape)}: it would be staged "
                               "through an unpinned temporary and block the host")
        if host.untyped_storage().data_ptr() not in self._staging:
            raise RuntimeError("host<->device copy through a buffer that is not a staging buffer")
        if self.pinned and not host.is_pinned():
            raise RuntimeError("host<->device copy through pageable memory: it would block the host")
        dst.copy_(src, non_blocking=True)
