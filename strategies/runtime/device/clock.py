"""The run clock: seconds since run start on one monotonic clock, shared by host and device records."""

from __future__ import annotations

import time


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def reset(self) -> None:
        """Start the run here (after setup), so run time 0 is the first moment a request can arrive."""
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def at(self, perf_s: float) -> float:
        """The run-clock time of a ``time.perf_counter()`` reading."""
        return perf_s - self.t0

    def client_time(self, now: float, rows: int, engine: object = None) -> float:
        """When a streaming client receives the tokens a step of ``engine`` handed out at ``now`` (``rows`` of
        them): here, at once; a simulated device may add a serving path (sim/config.py: SERVING_PATHS), one
        front end per engine that takes its steps' outputs in order (sim/device.py: VirtualClock.client_time)."""
        return now

    def charge_host(self, phase: str, requests: int) -> None:
        """A host phase ended. Real clocks have already counted it; a modelled one adds its cost."""

    def sleep_until(self, t: float) -> None:
        """Idle until ``t`` (never spins); returns at once if ``t`` has passed."""
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)
