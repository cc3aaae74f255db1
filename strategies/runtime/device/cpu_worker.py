"""The CPU as a device thread (``--cpu-device thread``): one worker thread of the host's process that runs
enqueued pieces in order.

The host enqueues a step and goes on; the worker runs its pieces and releases the step's lock, which the
host can wait on. Its tensors are this process's, within reach of a debugger or a test. Its cost: the
worker shares the interpreter's lock with the host, and every time it comes back from a torch call while
the host runs Python it waits for it (~0.1 ms a hand-off on a 2-vCPU VM, whatever the switch interval), so
a step runs longer beside a busy host — why the default CPU device is a process (``process.py``). The
contract (ready before work, failures at wait, a synchronising close) is ``stream.DeviceStream``'s.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.compute import compute_budget
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream, DeviceWork, Piece


class CpuWorkerStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, threads: int = 1, split: bool = False,
                 switch_interval_s: float = 1e-4) -> None:
        super().__init__(clock, nvtx, DeviceMemory(torch.device("cpu"), split))
        self._queue: queue.SimpleQueue[tuple[DeviceWork, list[Piece]] | None] = queue.SimpleQueue()
        # The worker's threads and a short switch interval for as long as the stream lives.
        self._budget: AbstractContextManager[int] | None = compute_budget(threads, switch_interval_s)
        self._budget.__enter__()
        self._thread = threading.Thread(target=self._run, name="slotbench-device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Inference mode for the thread's whole life: entering it per piece costs more than a small step.
        with torch.inference_mode():
            while (item := self._queue.get()) is not None:
                work, pieces = item
                # This thread is the device: its iteration range is its own, not the host's.
                with self.nvtx.range("iteration"):
                    self._run_pieces(work, pieces)
                work.finish()

    def _run_piece(self, work: DeviceWork, name: str, fn: Callable[..., None], args: tuple) -> None:
        with self.nvtx.range(name):
            start = self.clock.now()
            fn(*args)
            work.times[name] = (start, self.clock.now())

    def _submit(self, work: DeviceWork, pieces: list[Piece]) -> None:
        self._queue.put((work, pieces))

    def wait(self, work: DeviceWork) -> float:
        if work.done():
            waited = 0.0
        else:
            t = time.perf_counter()
            work.block()
            waited = time.perf_counter() - t
        self._raise_failure(work)
        return waited

    def close(self) -> None:
        if self._thread.is_alive():  # the worker runs (or, poisoned, skips) what is queued, then stops
            self._queue.put(None)
            self._thread.join()
        if self._budget is not None:  # close may be called again after a failure
            self._budget.__exit__(None, None, None)
            self._budget = None
