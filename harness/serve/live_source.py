"""The request source of a served engine: requests arrive from the HTTP front end (another thread) as they come.

It is the same contract a trace replay meets (``strategies/interface.py``: RequestSource), so the strategy's
loop is unchanged: ``poll`` hands out what has arrived, ``next_arrival_s`` blocks while nothing has. Aborts
(clients that went away) are carried out in ``poll``, on the engine's thread, between steps. On the simulated
device the virtual clock is paced to the wall clock: ``poll`` holds it, stopped, while the wall clock catches up
with it, and an arrival's time is the wall time since the server started — a GPU server priced by the simulator,
served for real.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from strategies.interface import Executor
from strategies.runtime.device.clock import Clock
from strategies.runtime.request import Request, Status
from strategies.runtime.sim.device import VirtualClock

IDLE_WAIT_S = 0.002  # an idle engine looks for arrivals this often (it is woken at once by one)


class ServerClosing(Exception):
    """The server is shutting down: the engine's loop stops, its unfinished requests fail."""


class LiveSource:
    def __init__(self, clock: Clock, paced: bool, notify: Callable[[], None]) -> None:
        self.clock = clock
        self.paced = paced  # the simulated device: hold its virtual clock to the wall clock
        self.notify = notify  # the front end: new tokens or ends to look at (called on the engine's thread)
        self.executor: Executor | None = None  # set before the loop runs: aborts are its to carry out
        self.between_steps: Callable[[], None] = _nothing  # the served engine's, at each poll (its thread)
        self.ended = 0  # requests the engine has ended (finished, failed, aborted) so far
        self.t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._arrived: deque[Request] = deque()
        self._aborts: list[tuple[Request, str]] = []
        self._closed = False

    def start(self) -> None:
        """The run starts now: time 0 on the run clock and on the wall clock alike."""
        self.clock.reset()
        self.t0 = time.perf_counter()

    def now_s(self) -> float:
        """Run-clock time of an arrival now: wall time since the start where the clock is paced."""
        return time.perf_counter() - self.t0 if self.paced else self.clock.now()

    # --- the front end's side (any thread) ---------------------------------------------------------
    def submit(self, r: Request) -> None:
        with self._cond:
            if self._closed:
                raise ServerClosing("the server is shutting down")
            r.arrival_s = self.now_s()
            self._arrived.append(r)
            self._cond.notify()

    def abort(self, r: Request, reason: str) -> None:
        with self._cond:
            self._aborts.append((r, reason))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    # --- RequestSource (the engine's thread) ---------------------------------------------------------
    def poll(self, now_s: float) -> list[Request]:
        self.between_steps()
        ahead = now_s - self.now_s() if self.paced else 0.0
        if ahead > 0:
            # The virtual clock waits for the wall clock, stopped: the wait is no host work. Were its measured host
            # time to flow, it would stay ahead by one step more each step (an 8B model's 10 ms steps, served, were
            # 3 s apart by the 365th).
            assert isinstance(self.clock, VirtualClock)
            stopped_at = self.clock.stop()
            time.sleep(ahead)
            self.clock.resume(stopped_at)
        with self._cond:
            if self._closed:
                raise ServerClosing("the server is shutting down")
            aborts, self._aborts = self._aborts, []
            held = [(r, reason) for r, reason in aborts if r in self._arrived]  # not handed to the engine yet
            for r, _ in held:
                self._arrived.remove(r)
            out = []
            while self._arrived and self._arrived[0].arrival_s <= now_s:
                out.append(self._arrived.popleft())
        for r, reason in held:
            r.end(Status.FAILED, reason, now_s)
        for r, reason in aborts:
            if not r.status.terminal:
                assert self.executor is not None
                self.executor.abort(r, reason)
        self.notify()
        return out

    def next_arrival_s(self) -> float | None:
        """When the next request arrives: the first one waiting, else — after waiting up to ``IDLE_WAIT_S``
        for one — now, so that an idle loop polls again (never None: more can always come). A fleet on the
        simulated device asks between its steps' ends, so this never blocks for long."""
        with self._cond:
            if not (self._arrived or self._aborts or self._closed):
                self._cond.wait(IDLE_WAIT_S)
            return self._arrived[0].arrival_s if self._arrived else max(self.now_s(), self.clock.now())

    @property
    def exhausted(self) -> bool:
        return False  # a server's requests end only at its shutdown (``ServerClosing``)

    def on_finished(self, request: Request) -> None:
        """(The front end learns of it at the next ``poll``: after the pacing, so that no client hears of an end
        before the server's clock reaches it.)"""
        self.ended += 1


def _nothing() -> None:
    pass
