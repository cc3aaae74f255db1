"""The simulated device's memory: the host's own, in numpy arrays — so a simulated run never imports torch.

The simulated device computes nothing (``sim/engine.py``): its pieces read and write the buffers' numpy
views, on the host. Its memory is therefore shared — a staging buffer's device twin is the buffer itself and
no transfer has anything to copy — and its buffers are numpy arrays of the dtypes the buffers name
(``buffers/mirrored.py``). The host fills the same buffers through the same code as on any device.
"""

from __future__ import annotations

import numpy as np


class SimMemory:
    def host(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype)

    def zeros(self, shape: tuple[int, ...], dtype: str, fill: float = 0) -> np.ndarray:
        # np.zeros takes pages the OS zeroes on first touch: a buffer the simulated device never writes (the
        # logits, [rows, the spec's vocabulary]) costs no memory
        return np.zeros(shape, dtype) if fill == 0 else np.full(shape, fill, dtype)

    def mirror(self, host: np.ndarray) -> np.ndarray:
        return host

    def numpy(self, host: np.ndarray) -> np.ndarray:
        return host

    def place(self, module: object) -> object:
        return module

    def upload(self, dev: np.ndarray, host: np.ndarray, n: int) -> None:
        """Nothing to copy: the device's twin is the buffer itself."""

    def download(self, host: np.ndarray, dev: np.ndarray, n: int) -> None:
        """Nothing to copy: the device's twin is the buffer itself."""
