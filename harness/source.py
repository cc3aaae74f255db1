"""Replay of a trace into an executor: open loop by arrival time, optionally capped in concurrency.

Requests become visible at their arrival time on the run clock. With ``max_concurrency`` at most that
many are in flight; the rest wait on the client side and are sent when one ends (closed loop when the
rate is infinite). As in ``vllm bench serve``, latency is measured from when a request is *sent*, so
a capped request's ``arrival_s`` is when it left the client.
"""

from __future__ import annotations

from collections.abc import Callable

from strategies.runtime.request import Request


class TraceSource:
    def __init__(self, requests: list[Request], max_concurrency: int | None = None,
                 on_end: Callable[[Request], None] | None = None) -> None:
        if max_concurrency is not None and max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be positive, got {max_concurrency}")
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.max_concurrency = max_concurrency
        self.on_end = on_end
        self._next = 0
        self._in_flight = 0
        self._gate_open_s = 0.0  # when the concurrency cap last made room
        self._now_s = 0.0

    def _gated(self) -> bool:
        return self.max_concurrency is not None and self._in_flight >= self.max_concurrency

    def poll(self, now_s: float) -> list[Request]:
        self._now_s = now_s
        out = []
        while self._next < len(self.requests) and not self._gated():
            r = self.requests[self._next]
            if r.arrival_s > now_s:
                break
            r.arrival_s = max(r.arrival_s, self._gate_open_s)
            out.append(r)
            self._next += 1
            self._in_flight += 1
        return out

    def next_arrival_s(self) -> float | None:
        if self._next >= len(self.requests) or self._gated():
            return None
        return max(self.requests[self._next].arrival_s, self._gate_open_s)

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.requests)

    def on_finished(self, request: Request) -> None:
        if self._gated():
            self._gate_open_s = self._now_s if request.finish_s is None else request.finish_s
        self._in_flight -= 1
        if self.on_end is not None:
            self.on_end(request)
