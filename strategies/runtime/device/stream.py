"""The device stream: where device work is enqueued, in order, and how the host waits for it.

On CUDA this is a ``torch.cuda.Stream`` with timing events; enqueueing a piece issues its kernels and
copies on the stream and returns at once. On CPU it is one worker thread that runs enqueued pieces in
order, with a lock the host can wait on, so host/device overlap is real on CPU too. That only pays if
the device work runs without the GIL: an eager step re-takes the GIL for every op and starves the host
thread, so the engine hands the worker TorchScript calls (which release it) and the switch interval is
shortened while the stream lives. Both streams move data through the same ``DeviceMemory``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.compute import compute_budget
from strategies.runtime.device.nvtx import Nvtx

Piece = tuple[str, Callable[[], None]]


@dataclass
class DeviceWork:
    """Handle to one enqueued step. ``times`` maps piece name → (start_s, end_s) on the run clock once
    the step is waited for."""

    iteration: int
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    error: BaseException | None = None
    # Held until the work is done. A bare lock wakes a waiting host in ~24 us here, an Event in ~37 us:
    # on CPU that wake-up sits between two device steps, so it is device idle time.
    _pending: threading.Lock = field(default_factory=threading.Lock)
    _events: list = field(default_factory=list)  # CUDA: (name, start event, end event); pipeline: receives
    stages: list[tuple[float, float]] = field(default_factory=list)  # pipeline: each stage's compute (start, end)

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
    memory: DeviceMemory

    def __init__(self, clock: Clock, nvtx: Nvtx, memory: DeviceMemory) -> None:
        self.clock = clock
        self.nvtx = nvtx
        self.memory = memory
        self.device = memory.device

    def enqueue(self, iteration: int, pieces: list[Piece]) -> DeviceWork:
        raise NotImplementedError

    def wait(self, work: DeviceWork) -> float:
        """Block until ``work`` is done; returns the seconds the host spent blocked. Re-raises a failure."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class CpuWorkerStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, threads: int = 1, split: bool = False,
                 switch_interval_s: float = 1e-4) -> None:
        super().__init__(clock, nvtx, DeviceMemory(torch.device("cpu"), split))
        self._queue: queue.SimpleQueue[DeviceWork | None] = queue.SimpleQueue()
        self._pieces: dict[int, list[Piece]] = {}
        # The worker's threads and a short switch interval for as long as the stream lives.
        self._budget: AbstractContextManager[int] | None = compute_budget(threads, switch_interval_s)
        self._budget.__enter__()
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
                    # This thread is the device: its iteration range is its own, not the host's.
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
        if self._budget is not None:  # close may be called again after a failure
            self._budget.__exit__(None, None, None)
            self._budget = None


class CudaStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, device: torch.device) -> None:
        super().__init__(clock, nvtx, DeviceMemory(device, split=True))
        self.stream = torch.cuda.Stream(device=device)
        # Device times are mapped onto the run clock through one reference event, kept as a raw
        # perf_counter() reading: the run clock may be reset after the stream is built (it is), and
        # each conversion uses the clock's start as it is then.
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(self.stream)
        self._ref.synchronize()
        self._ref_perf_s = time.perf_counter()

    def enqueue(self, iteration: int, pieces: list[Piece]) -> DeviceWork:
        work = DeviceWork(iteration)
        # Issued on the host thread: its phase ranges nest in the host's own iteration range (one per
        # step, never a second), and Nsight Systems projects the kernels onto them.
        with torch.cuda.stream(self.stream), torch.inference_mode():
            for name, fn in pieces:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                with self.nvtx.range(name):
                    fn()
                end.record(self.stream)
                work._events.append((name, start, end))
        return work

    def wait(self, work: DeviceWork) -> float:
        t = time.perf_counter()
        if work._events:
            work._events[-1][2].synchronize()
        waited = time.perf_counter() - t
        ref = self.clock.at(self._ref_perf_s)
        for name, start, end in work._events:
            work.times[name] = (ref + self._ref.elapsed_time(start) / 1e3, ref + self._ref.elapsed_time(end) / 1e3)
        work._events.clear()
        if not work.done():
            work._finish()
        return waited


def make_stream(device: str, clock: Clock, nvtx: Nvtx, threads: int = 1, memory: str = "shared") -> DeviceStream:
    if device == "cpu":
        return CpuWorkerStream(clock, nvtx, threads=threads, split=memory == "split")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine")
        return CudaStream(clock, nvtx, torch.device(device))
    raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
