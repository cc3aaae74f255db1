"""The device stream a run asks for: the CPU as a device process or a thread (shared or split memory), or a
CUDA stream. Each is imported when a run asks for it: they import torch, which a simulated run never does
(``buffers/sim_memory.py``), and strategies.config reads ``CPU_DEVICES`` from here."""

from __future__ import annotations

from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream

CPU_DEVICES = ("process", "thread")  # --cpu-device


def make_stream(device: str, clock: Clock, nvtx: Nvtx, threads: int = 1, memory: str = "shared",
                cpu_device: str = "process") -> DeviceStream:
    """``cpu_device``: the CPU as a device process (the default: it shares no interpreter lock with the host,
    so host work does not slow a step), or as a thread of this process (its tensors within reach of a
    debugger or a test)."""
    if device == "cpu":
        if cpu_device == "process":
            from strategies.runtime.device.process import ProcessStream

            return ProcessStream(clock, nvtx, threads=threads, split=memory == "split")
        from strategies.runtime.device.cpu_worker import CpuWorkerStream

        return CpuWorkerStream(clock, nvtx, threads=threads, split=memory == "split")
    if device.startswith("cuda"):
        import torch

        from strategies.runtime.device.cuda import CudaStream

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine")
        return CudaStream(clock, nvtx, torch.device(device))
    raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
