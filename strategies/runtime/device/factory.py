"""The device stream a run asks for: the CPU worker (shared or split memory) or a CUDA stream."""

from __future__ import annotations

import torch

from strategies.runtime.device.clock import Clock
from strategies.runtime.device.cpu_worker import CpuWorkerStream
from strategies.runtime.device.cuda import CudaStream
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream


def make_stream(device: str, clock: Clock, nvtx: Nvtx, threads: int = 1, memory: str = "shared") -> DeviceStream:
    if device == "cpu":
        return CpuWorkerStream(clock, nvtx, threads=threads, split=memory == "split")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine")
        return CudaStream(clock, nvtx, torch.device(device))
    raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
