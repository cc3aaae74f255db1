"""The device stream's contract: where device work is enqueued, in order, and how the host waits for it.

Every device — a CUDA stream (``cuda.py``), the CPU worker thread that plays one (``cpu_worker.py``), the
simulated device, the pipeline's stage processes — keeps the same contract, and the parts that decide it
are this module's code, shared by all of them:

- **ready before work.** The engine builds its tensors (weights, KV pools, decoder state, buffer mirrors)
  first, then calls ``ready()``; work enqueued before that is refused. On CUDA those tensors are filled on
  the default stream, and ``ready`` makes the device's own stream wait for those fills: without it the
  first prefill could write KV that a still-running zero-fill then wipes.
- **a failure surfaces at ``wait``**, never at ``enqueue``, whichever device raised it: the failing piece's
  error is kept on its ``DeviceWork``, and the stream is poisoned — no later piece runs, every later
  ``wait`` raises the same error.
- **a dead device is seen between steps too**: ``fault`` answers, without blocking, whether the device is
  known to be gone (a device process that exited) — a fleet asks it of every worker, idle ones included.
- **``close`` synchronises**: it returns only when no piece is running or queued, so the engine's tensors
  can be freed after a failure or Ctrl-C while steps were still in flight.

A piece is data, not a closure: (name, a method of the engine or a module-level function, its arguments),
so that a device in another process (``process.py``) can run the same piece on its own engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strategies.runtime.buffers.mirrored import Memory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx

if TYPE_CHECKING:
    import torch

# (name, callable, arguments): an engine method (arguments: ints, a BufferSet) or a module-level function
Piece = tuple[str, Callable[..., None], tuple]


def hold_for(seconds: float) -> None:
    """A piece that keeps the device busy (``DeviceStream.hold``)."""
    time.sleep(seconds)


@dataclass
class DeviceWork:
    """Handle to one enqueued step. ``times`` maps piece name → (start_s, end_s) on the run clock once
    the step is waited for."""

    iteration: int
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    error: BaseException | None = None  # the stream's failure, raised by wait()
    # Held until the work is done. A bare lock wakes a waiting host sooner than an Event (docs/host-path.md):
    # on CPU that wake-up sits between two device steps, so it is device idle time.
    _pending: threading.Lock = field(default_factory=threading.Lock)
    events: list = field(default_factory=list)  # CUDA: (name, start event, end event); pipeline: receives
    stages: list[tuple[float, float]] = field(default_factory=list)  # pipeline: each stage's compute (start, end)

    def __post_init__(self) -> None:
        self._pending.acquire()

    def done(self) -> bool:
        return not self._pending.locked()

    def finish(self) -> None:
        """The device's side: the work is done (its times are set); a waiting host wakes."""
        self._pending.release()

    def block(self) -> None:
        """The host's side: sleep until ``finish``."""
        with self._pending:
            pass


class DeviceStream:
    memory: Memory

    def __init__(self, clock: Clock, nvtx: Nvtx, memory: Memory) -> None:
        self.clock = clock
        self.nvtx = nvtx
        self.memory = memory
        self.is_ready = False
        self.failure: BaseException | None = None  # the first piece that raised: the stream is poisoned

    def ready(self) -> None:
        """The engine's tensors are built: order the stream after whatever filled them, and accept work."""
        self.is_ready = True

    def check_ready(self) -> None:
        if not self.is_ready:
            raise RuntimeError("device stream: work enqueued before the engine's tensors were marked ready "
                               "(stream.ready() after the engine is built)")

    def enqueue(self, iteration: int, pieces: list[Piece]) -> DeviceWork:
        """Issue ``pieces`` in order after everything enqueued before; returns at once."""
        self.check_ready()
        work = DeviceWork(iteration)
        self._submit(work, pieces)
        return work

    def build_engine(self, cls: type, cfg: object, model: torch.nn.Module, **kwargs: object) -> object:
        """``cls(cfg, model, self, **kwargs)``: the engine whose pieces this stream runs (a device in another
        process also builds the same engine there, on the staging buffers this one allocates)."""
        return cls(cfg, model, self, **kwargs)

    def hold(self, seconds: float) -> DeviceWork:
        """Keep the device busy for ``seconds`` after what is queued (tests: a launch must not wait for it)."""
        return self.enqueue(-1, [("hold", hold_for, (seconds,))])

    def query(self, work: DeviceWork) -> bool:
        """Whether ``work`` is done, without blocking."""
        return work.done()

    def wait(self, work: DeviceWork) -> float:
        """Block until ``work`` is done; returns the seconds the host spent blocked. Re-raises a failure."""
        raise NotImplementedError

    def fault(self) -> BaseException | None:
        """Why the device is gone, if it is known to be without waiting for a step (a device process that
        exited); None while it may still answer. A piece's error is not this: it surfaces at ``wait``."""
        return None

    def close(self) -> None:
        """Return once nothing is running or queued on the device (the caller frees its tensors next)."""

    # --- shared by every stream ------------------------------------------------------------------------
    def _submit(self, work: DeviceWork, pieces: list[Piece]) -> None:
        """Hand ``work`` to the device (a queue, a stream, a clock)."""
        raise NotImplementedError

    def _run_pieces(self, work: DeviceWork, pieces: list[Piece]) -> None:
        """Run each piece through ``_run_piece`` in order, unless the stream already failed; a failure is
        kept, on this work and for every later one, for ``wait`` to raise."""
        if self.failure is None:
            try:
                for name, fn, args in pieces:
                    self._run_piece(work, name, fn, args)
            except BaseException as exc:  # handed to the host at wait()
                self.failure = exc
        work.error = self.failure

    def _run_piece(self, work: DeviceWork, name: str, fn: Callable[..., None], args: tuple) -> None:
        fn(*args)

    def _raise_failure(self, work: DeviceWork) -> None:
        if work.error is not None:
            raise work.error
