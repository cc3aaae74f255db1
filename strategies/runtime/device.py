"""The device stream: where device work is enqueued, in order, and how the host waits for it.

On CUDA this is a ``torch.cuda.Stream`` with events, pinned host buffers and non-blocking copies. On
CPU it is one worker thread that runs enqueued work in order, with events the host can wait on, so
host/device overlap is real on CPU too. That only pays if the device work runs without the GIL: an
eager step re-takes the GIL for every op and starves the host thread, so the engine hands the worker
TorchScript calls (which release it) and the switch interval is shortened while the stream lives.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from strategies.runtime.clock import Clock
from strategies.runtime.tracing import Nvtx

Piece = tuple[str, Callable[[], None]]


@dataclass
class DeviceWork:
    """Handle to one enqueued step. ``times`` maps piece name → (start_s, end_s) once it is done."""

    iteration: int
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    error: BaseException | None = None
    # Held until the work is done. A bare lock wakes a waiting host in ~24 us here, an Event in ~37 us:
    # on CPU that wake-up sits between two device steps, so it is device idle time.
    _pending: threading.Lock = field(default_factory=threading.Lock)
    _events: list = field(default_factory=list)  # CUDA: (name, start event, end event)

    def __post_init__(self) -> None:
        self._pending.acquire()

    def done(self) -> bool:
        return not self._pending.locked()

    def _finish(self) -> None:
        self._pending.release()

    def _block(self) -> None:
        with self._pending:
            pass


class DeviceStream:
    device: torch.device

    def __init__(self, clock: Clock, nvtx: Nvtx) -> None:
        self.clock = clock
        self.nvtx = nvtx

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def device_mirror(self, host: torch.Tensor) -> torch.Tensor:
        """The device-side twin of a host buffer; on CPU the same tensor (the buffer set is owned by
        one step at a time, so there is nothing to race with)."""
        return host

    @staticmethod
    def copy_prefix(dst: torch.Tensor, src: torch.Tensor, n: int, dim: int = 0) -> None:
        if dst is not src and n > 0:
            dst.narrow(dim, 0, n).copy_(src.narrow(dim, 0, n), non_blocking=True)

    def enqueue(self, iteration: int, pieces: list[Piece]) -> DeviceWork:
        raise NotImplementedError

    def wait(self, work: DeviceWork) -> float:
        """Block until ``work`` is done; returns the seconds the host spent blocked. Re-raises a failure."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class CpuWorkerStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, threads: int = 1, switch_interval_s: float = 1e-4) -> None:
        super().__init__(clock, nvtx)
        self.device = torch.device("cpu")
        self._queue: queue.SimpleQueue[DeviceWork | None] = queue.SimpleQueue()
        self._pieces: dict[int, list[Piece]] = {}
        self._old_interval = sys.getswitchinterval()
        sys.setswitchinterval(switch_interval_s)
        if threads > 0:
            torch.set_num_threads(threads)
        self._thread = threading.Thread(target=self._run, name="slotbench-device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed: BaseException | None = None
        now, nvtx = self.clock.now, self.nvtx
        # Inference mode for the thread's whole life: entering it per piece costs more than a small step.
        with torch.inference_mode():
            while (work := self._queue.get()) is not None:
                pieces = self._pieces.pop(id(work))
                if failed is None:  # after a failure the stream is poisoned: later work is not run
                    nvtx.push("iteration")
                    try:
                        for name, fn in pieces:
                            nvtx.push(name)
                            start = now()
                            fn()
                            work.times[name] = (start, now())
                            nvtx.pop()
                    except BaseException as exc:  # handed to the host thread
                        failed = exc
                        nvtx.pop()
                    finally:
                        nvtx.pop()
                work.error = failed
                work._finish()

    def enqueue(self, iteration: int, pieces: list[Piece]) -> DeviceWork:
        work = DeviceWork(iteration)
        self._pieces[id(work)] = pieces
        self._queue.put(work)
        return work

    def wait(self, work: DeviceWork) -> float:
        if work.done():
            waited = 0.0
        else:
            t = time.perf_counter()
            work._block()
            waited = time.perf_counter() - t
        if work.error is not None:
            raise work.error
        return waited

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)
        sys.setswitchinterval(self._old_interval)


class CudaStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, device: torch.device) -> None:
        super().__init__(clock, nvtx)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # Device times are mapped onto the run clock through one reference event.
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(self.stream)
        self._ref.synchronize()
        self._ref_s = clock.now()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).pin_memory()

    def device_mirror(self, host: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(host, device=self.device)

    def enqueue(self, iteration: int, pieces: list[Piece]) -> DeviceWork:
        work = DeviceWork(iteration)
        with torch.cuda.stream(self.stream), torch.inference_mode():
            self.nvtx.push("iteration")
            try:
                for name, fn in pieces:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(self.stream)
                    with self.nvtx.range(name):
                        fn()
                    end.record(self.stream)
                    work._events.append((name, start, end))
            finally:
                self.nvtx.pop()
        return work

    def wait(self, work: DeviceWork) -> float:
        t = time.perf_counter()
        if work._events:
            work._events[-1][2].synchronize()
        waited = time.perf_counter() - t
        for name, start, end in work._events:
            work.times[name] = (self._ref_s + self._ref.elapsed_time(start) / 1e3,
                                self._ref_s + self._ref.elapsed_time(end) / 1e3)
        work._events.clear()
        if not work.done():
            work._finish()
        return waited


def make_stream(device: str, clock: Clock, nvtx: Nvtx, threads: int = 1) -> DeviceStream:
    if device == "cpu":
        return CpuWorkerStream(clock, nvtx, threads=threads)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine")
        return CudaStream(clock, nvtx, torch.device(device))
    raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
