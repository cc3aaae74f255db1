"""A CUDA device: a ``torch.cuda.Stream`` of the engine's own, timed with events.

Enqueueing a piece issues its kernels and copies on the stream from the host thread and returns at once
(its NVTX range nests in the host's iteration range, and Nsight Systems projects the kernels onto it).
The engine's tensors are filled on the default stream while it is built; ``ready`` makes this stream wait
for those fills, and ``close`` synchronises it before anything is freed. The rest of the contract is
``stream.DeviceStream``'s, the code every device shares: a failing piece surfaces at ``wait``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream, DeviceWork, Piece, hold_for


class CudaStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, device: torch.device) -> None:
        super().__init__(clock, nvtx, DeviceMemory(device, split=True))
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # Device times are mapped onto the run clock through one reference event, kept as a raw
        # perf_counter() reading taken after the event completed (so mapped times are never early): the
        # run clock may be reset after the stream is built (it is), and each conversion uses the clock's
        # start as it is then.
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(self.stream)
        self._ref.synchronize()
        self._ref_perf_s = time.perf_counter()

    def ready(self) -> None:
        """Everything the engine built was filled on the default stream: this stream waits for it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        super().ready()

    def _submit(self, work: DeviceWork, pieces: list[Piece]) -> None:
        with torch.cuda.stream(self.stream), torch.inference_mode():
            self._run_pieces(work, pieces)

    def _run_piece(self, work: DeviceWork, name: str, fn: Callable[..., None], args: tuple) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        with self.nvtx.range(name):
            if fn is hold_for:  # on the GPU: a kernel that spins for cycles (~2e9 a second on H100/H200: approximate)
                torch.cuda._sleep(int(args[0] * 2e9))
            else:
                fn(*args)
        end.record(self.stream)
        work.events.append((name, start, end))

    def query(self, work: DeviceWork) -> bool:
        return not work.events or work.events[-1][2].query()

    def wait(self, work: DeviceWork) -> float:
        t = time.perf_counter()
        if work.error is not None:  # a piece failed while it was issued: what was issued before it drains
            self.stream.synchronize()
        elif work.events:
            work.events[-1][2].synchronize()
        waited = time.perf_counter() - t
        ref = self.clock.at(self._ref_perf_s)
        for name, start, end in work.events:
            work.times[name] = (ref + self._ref.elapsed_time(start) / 1e3, ref + self._ref.elapsed_time(end) / 1e3)
        work.events.clear()
        if not work.done():
            work.finish()
        self._raise_failure(work)
        return waited

    def close(self) -> None:
        self.stream.synchronize()
