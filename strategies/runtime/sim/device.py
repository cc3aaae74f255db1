"""A virtual clock and a device stream that runs device pieces instantly and stamps modelled times.

Host time is either *measured* — the clock flows with real time while host code runs — or *modelled* —
each host phase adds a configured cost. Device time is the cost model's. The device is busy from
max(launch time, end of the previous step) for the predicted duration, so under overlap the host's
work for step n+1 falls inside device step n exactly as on a GPU. Waiting for a step moves the clock to
its end; an idle executor's sleep until the next arrival is a jump, not a wait.

The host KV tier's copies (``COPY_PIECE``) run on a copy engine of their own, as TensorRT-LLM's copy streams do —
and, as there, only once the work before them is done (its ``prepare_resources`` syncs the transfer manager with
the compute stream before it launches offloads and onboards: an evicted block may still be written by the step
before), and the step's compute waits for them to end. So a step's copies are never hidden behind compute.
"""

from __future__ import annotations

import time

from strategies.runtime.buffers.sim_memory import SimMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream, DeviceWork, Piece
from strategies.runtime.sim.config import ServingPath

COPY_PIECE = "kv_host_copy"  # the engine's piece that moves blocks between the GPU pool and the host tier


class VirtualClock(Clock):
    def __init__(self, host_time: str = "measured", host_s_per_iteration: float = 0.0,
                 host_s_per_request: float = 0.0, serving: ServingPath | None = None) -> None:
        if host_time not in ("measured", "modelled"):
            raise ValueError(f"--host-time {host_time!r}: expected measured or modelled")
        self.host_time = host_time
        self.host_s_per_iteration = host_s_per_iteration
        self.host_s_per_request = host_s_per_request
        self.serving = serving  # None: a client sees tokens when the host holds them
        # each engine's front end (the serving path's one output process): when it is done with its last step
        self._front_end: dict[object, float] = {}
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self._virtual = 0.0
        self._anchor = self.t0
        self._front_end = {}

    def now(self) -> float:
        if self.host_time == "measured":
            return self._virtual + (time.perf_counter() - self._anchor)
        return self._virtual

    def advance_to(self, t: float) -> None:
        if t > self.now():
            self._virtual, self._anchor = t, time.perf_counter()

    def sleep_until(self, t: float) -> None:
        self.advance_to(t)

    def stop(self) -> float:
        """Stop the clock (the simulated device's own work is not host time): its time now, for ``resume``."""
        return self.now()

    def resume(self, t: float) -> None:
        """Restart a clock stopped at ``t``: the real time since ``stop`` does not pass on it."""
        self._virtual, self._anchor = t, time.perf_counter()

    def client_time(self, now: float, rows: int, engine: object = None) -> float:
        """The serving path as a queue: ``engine``'s front end takes each step's outputs in order, so it starts on
        this step's ``rows`` once they exist (``now``) and it is done with the previous step's; its client then
        reads them ``fixed_s`` later. A step never reaches the client before the one before it, however many
        fewer rows it has."""
        if self.serving is None:
            return now
        done = max(now, self._front_end.get(engine, 0.0)) + self.serving.per_row_s * rows
        self._front_end[engine] = done
        return done + self.serving.fixed_s

    def charge_host(self, phase: str, requests: int) -> None:
        if self.host_time == "modelled":
            self._virtual += self.host_s_per_iteration / 3 + self.host_s_per_request * requests


class SimStream(DeviceStream):
    def __init__(self, clock: VirtualClock, nvtx: Nvtx, launch_latency_s: float = 0.0,
                 sync_latency_s: float = 0.0) -> None:
        super().__init__(clock, nvtx, SimMemory())
        self.clock: VirtualClock = clock
        self.launch_latency_s = launch_latency_s
        self.sync_latency_s = sync_latency_s
        self._free_at = 0.0
        self._copy_free_at = 0.0  # when the copy engine is done with the copies enqueued so far

    def _copies(self, pieces: list[Piece], durations: dict[str, float], work: DeviceWork, ready: float,
                busy_until: float) -> float:
        """The step's host-tier copies on the copy engine, from ``ready`` once the compute before them is done
        (``busy_until``): when its compute may start (``ready`` with no copies)."""
        if not pieces or pieces[0][0] != COPY_PIECE:
            return ready
        start = max(ready, busy_until + self.launch_latency_s, self._copy_free_at)
        self._copy_free_at = end = start + durations.get(COPY_PIECE, 0.0)
        work.times[COPY_PIECE] = (start, end)
        return end

    def _submit(self, work: DeviceWork, pieces: list[Piece]) -> None:
        """The pieces' work (the simulated decoder's numpy rule; no torch op), off the virtual clock; a
        failure goes to ``wait``."""
        t = self.clock.stop()  # (not a context manager: contextlib's cost, docs/host-path.md)
        try:
            self._run_pieces(work, pieces)
        finally:
            self.clock.resume(t)

    def enqueue(self, iteration: int, pieces: list[Piece], durations: dict[str, float] | None = None) -> DeviceWork:
        durations = durations or {}
        ready = self.clock.now() + self.launch_latency_s
        work = super().enqueue(iteration, pieces)
        t = max(self._copies(pieces, durations, work, ready, self._free_at), self._free_at + self.launch_latency_s)
        for name, *_ in pieces:
            if name == COPY_PIECE:
                continue
            d = durations.get(name, 0.0)
            work.times[name] = (t, t + d)
            t += d
        self._free_at = t
        work.finish()
        return work

    def wait(self, work: DeviceWork) -> float:
        self._raise_failure(work)
        end = max(t for _, t in work.times.values())
        now = self.clock.now()
        if end <= now:  # already done: nothing to wait for, nobody to wake
            return 0.0
        self.clock.advance_to(end + self.sync_latency_s)
        return end + self.sync_latency_s - now


class SimPipelineStream(SimStream):
    """The simulated device as N pipeline stages: each stage is busy for its share of a micro-batch's
    forward (``stage_s``, from the cost model) and free for the next as soon as it is done, so stage 0
    runs micro-batch k+1 while stage 1 runs k. A stage starts once the previous stage's hidden states
    arrived (``hop_s`` later) and it is free; the last stage samples."""

    def __init__(self, clock: VirtualClock, nvtx: Nvtx, stages: int, launch_latency_s: float = 0.0,
                 sync_latency_s: float = 0.0) -> None:
        super().__init__(clock, nvtx, launch_latency_s, sync_latency_s)
        self._stage_free = [0.0] * stages

    def enqueue(self, iteration: int, pieces: list[Piece], durations: dict[str, float] | None = None,
                stage_s: list[float] | None = None, hop_s: float = 0.0) -> DeviceWork:
        work = DeviceStream.enqueue(self, iteration, pieces)
        assert stage_s is not None and durations is not None
        ready = self._copies(pieces, durations, work, self.clock.now() + self.launch_latency_s, self._stage_free[0])
        for s, d in enumerate(stage_s):
            start = max(ready, self._stage_free[s])
            work.stages.append((start, start + d))
            self._stage_free[s] = start + d
            ready = start + d + hop_s
        end = work.stages[-1][1]
        work.times["forward"] = (work.stages[0][0], end)
        work.times["sample"] = (end, end + durations.get("sample", 0.0))
        self._stage_free[-1] = work.times["sample"][1]
        work.finish()
        return work
