"""The device process's side: build an engine on the host's staging buffers, then run the pieces it is sent.

The engine is the host's own class, built with the same sizes over a ``DeviceSideMemory`` (the host's
staging buffers, handed out in allocation order) and a ``LocalStream`` that runs each piece as it arrives
(``DeviceStream._run_pieces``: the failure and poisoning rules every device shares). A step's host ints
(``BufferSet.host_state``) arrive with its pieces. Nothing here shares a GIL with the host.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener

import torch

from strategies.runtime.buffers.process_memory import DeviceSideMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream, DeviceWork
from strategies.runtime.kv_transfer.gloo_link import GlooLink

# Both sides poll for the other's next message this long before they block: a process woken from a blocked
# read takes a while on a VM (docs/host-path.md), which every synchronous step would pay twice; a GPU answers
# in microseconds (and CUDA's default wait spins too). After a step, the device polls through the host's next
# schedule and prepare, so it starts the next step warm; a run with nothing to do blocks after POLL_S.
POLL_S = 0.002
# The host waiting for a step it launched polls through the whole step (up to this long), as a CUDA host
# spins in synchronize: one that blocked after POLL_S woke cold, and its next postprocess and prepare ran
# slower for it (docs/host-path.md). Each turn yields
# the core, so the device's threads and other processes still run.
HOST_WAIT_POLL_S = 0.1


def poll_for(conn: Connection, seconds: float) -> None:
    """Return once ``conn`` has a message, or after ``seconds`` (the caller then blocks on it). Each turn
    yields the core to any other process ready to run: an idle machine sees the message within microseconds,
    a busy one (another run, a test worker) is not starved by the wait."""
    deadline = time.perf_counter() + seconds
    while not conn.poll(0) and time.perf_counter() < deadline:
        os.sched_yield()


class LocalStream(DeviceStream):
    """Runs pieces where they are enqueued (this process is the device), timed in raw ``perf_counter``
    seconds, which the host maps onto its run clock."""

    def __init__(self, nvtx: Nvtx, memory: DeviceSideMemory) -> None:
        clock = Clock()
        clock.t0 = 0.0  # raw perf_counter readings: the same clock in both processes
        super().__init__(clock, nvtx, memory)

    def run(self, work: DeviceWork, pieces: list) -> None:
        with self.nvtx.range("iteration"):
            self._run_pieces(work, pieces)

    def _run_piece(self, work: DeviceWork, name: str, fn: Callable[..., None], args: tuple) -> None:
        with self.nvtx.range(name):
            start = time.perf_counter()
            fn(*args)
            work.times[name] = (start, time.perf_counter())


class Device:
    """One engine built on the host's buffers."""

    def __init__(self, cls_path: str, cfg: object, model: torch.nn.Module, kwargs: dict, staging: list,
                 threads: int, split: bool, instrument: bool) -> None:
        module, _, name = cls_path.partition(":")
        cls = getattr(importlib.import_module(module), name)
        torch.set_num_threads(threads)
        self.stream = LocalStream(Nvtx(instrument), DeviceSideMemory(split, staging))
        self.engine = cls(cfg, model, self.stream, **kwargs)
        self.stream.ready()

    def run(self, iteration: int, pieces: list, states: dict, fault: int | None) -> tuple:
        engine = self.engine
        engine.fault_at_iteration = fault
        for index, state in states.items():
            engine.buffer_sets[index].set_host_state(state)
        work = DeviceWork(iteration)
        self.stream.run(work, [(name, self._resolve(target), tuple(self._arg(a) for a in args))
                               for name, target, args in pieces])
        error = None if work.error is None else (type(work.error).__name__, str(work.error))
        if error is not None and getattr(engine, "kv_staging", None) is not None:
            engine.kv_staging.link = None  # a failed device leaves the KV link: sends to it fail now, not later
        return "done", work.times, error

    def join_link(self, port: int, rank: int, world: int) -> None:
        """Disaggregated serving: join the KV link among the deployment's device processes as ``rank``."""
        assert self.engine.kv_staging is not None, "the link moves KV through the staging buffer"
        self.engine.kv_staging.link = GlooLink(port, rank, world)

    def _resolve(self, target: tuple) -> Callable[..., None]:
        if target[0] == "engine":
            return getattr(self.engine, target[1])
        return getattr(importlib.import_module(target[1]), target[2])

    def _arg(self, a: object) -> object:
        return self.engine.buffer_sets[a[1]] if isinstance(a, tuple) and a and a[0] == "bufs" else a


def load_model(payload: bytes, scripted: bool) -> torch.nn.Module:
    buf = io.BytesIO(payload)
    return torch.jit.load(buf) if scripted else torch.load(buf, weights_only=False)


def serve(conn: Connection) -> None:
    """The process's entry point: requests in order, one reply each, until told to exit or the host is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's: it closes the device
    device: Device | None = None
    models: dict[int, torch.nn.Module] = {}  # the last model sent, by the host's key (warm-up, then the run)
    with torch.inference_mode():
        while True:
            poll_for(conn, POLL_S)
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the host is gone
                return
            kind = msg[0]
            if kind == "exit":
                return
            try:
                if kind == "run":
                    reply = device.run(*msg[1:])  # type: ignore[union-attr]
                elif kind == "model":
                    models.clear()
                    models[msg[1]] = load_model(msg[2], msg[3])
                    reply = ("ok",)
                elif kind == "build":
                    device = None  # the previous engine's tensors go with its last reference
                    cls_path, cfg, key, kwargs, staging, threads, split, instrument = msg[1:]
                    device = Device(cls_path, cfg, models[key], kwargs, staging, threads, split, instrument)
                    reply = ("ok",)
                elif kind == "link":
                    device.join_link(*msg[1:])  # type: ignore[union-attr]
                    reply = ("ok",)
                elif kind == "close":
                    device = None  # its tensors go now (reference counting), before the host builds the next
                    reply = ("ok",)
                else:
                    reply = ("error", "ValueError", f"device process: unknown request {kind!r}")
            except Exception as exc:  # a refused build, a lost engine: the host says why
                reply = ("error", type(exc).__name__, str(exc))
            conn.send(reply)


def main() -> None:
    """``python -m strategies.runtime.device.process_server ADDRESS``: listen once, serve the host that connects."""
    key = bytes.fromhex(os.environ.pop("SLOTBENCH_DEVICE_KEY"))
    listener = Listener(sys.argv[1], family="AF_UNIX", authkey=key)
    conn = listener.accept()
    with contextlib.suppress(OSError):
        listener.close()  # removes the socket file: one host only
    serve(conn)


if __name__ == "__main__":
    main()
