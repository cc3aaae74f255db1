"""Replay of a trace into an executor: open loop by arrival time, optionally capped in concurrency.

Requests become visible at their arrival time on the run clock. With ``max_concurrency`` at most that
many are in flight; the rest wait on the client side and are sent when one ends (closed loop when the
rate is infinite). As in ``vllm bench serve``, latency is measured from when a request is *sent*, so
a capped request's ``arrival_s`` is when it left the client.

Multi-turn sessions (AIPerf's conversations): a session's first turn arrives like any request; turn
k + 1 is sent ``turn_delay_s`` after turn k's last token, its prompt the session's history (every
earlier prompt and the tokens actually generated) followed by its own. A session whose turn ends
without finishing (rejected) ends there: its later turns are never sent and are recorded as rejected
with the reason. The concurrency cap counts sessions: a session holds its place from its first turn's
send to its last turn's end, think times included.

A client time-out (``request_timeout_s``: inference-perf's ``load.request_timeout``, aiohttp's total time-out) gives
up on a request that has not ended by its deadline (``client_deadline``), response stream included: the engine aborts
it (``Executor.abort``, as vLLM aborts a request whose connection closed) and it fails with the reason, as the client
records it. It is checked whenever the engine polls (between steps); an executor that cannot abort keeps no
time-out.

A load generator's stages (``stage_drain``: inference-perf's, ``harness/traces/stage_drain.py``): a stage's requests
are sent only once every request of the stage before has ended, and the whole stage moves, its gaps kept, to the
clock it then starts on. Sessions have no stages.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable
from itertools import count, pairwise

import numpy as np

from harness.traces.stage_drain import StageDrain
from strategies.runtime.request import Request, Status

UNSENT = "session ended"  # how the reason of a turn its session never sent begins
CEIL_THRESHOLD_S = 5.0  # aiohttp's ClientTimeout.ceil_threshold: a time-out this long or longer ends on a whole second


def client_deadline(sent_s: float, timeout_s: float) -> float:
    """When the client gives up on a request sent at ``sent_s``. aiohttp (inference-perf's client) rounds the deadline
    of a time-out of ``CEIL_THRESHOLD_S`` or more up to a whole second of its event loop's clock
    (``helpers.TimeoutHandle.start``), so its default 300 s ends 300-301 s after the send, as the measured reasoning
    run's failures did (300.0-301.0 s, mean 300.5). The loop clock's phase is unknown: the run clock's stands in."""
    when = sent_s + timeout_s
    return float(math.ceil(when)) if timeout_s >= CEIL_THRESHOLD_S else when


def end_s(r: Request) -> float:
    """When ``r`` ended as its client saw it: its last token, its failure, or (rejected) its send."""
    if r.status is Status.FINISHED and r.finish_s is not None:
        return r.finish_s
    return r.failed_s if r.failed_s is not None else r.arrival_s


class TraceSource:
    def __init__(self, requests: list[Request], max_concurrency: int | None = None,
                 on_end: Callable[[Request], None] | None = None, request_timeout_s: float | None = None,
                 abort: Callable[[Request, str], None] | None = None, stage_drain: StageDrain | None = None) -> None:
        if max_concurrency is not None and max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be positive, got {max_concurrency}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive, got {request_timeout_s}")
        self.request_timeout_s = request_timeout_s if abort is not None else None
        self._abort = abort
        self._deadlines: list[tuple[float, int, Request]] = []  # sent requests by when their client gives up
        starts, sessions = [], {}
        for r in requests:
            if r.session_id is None:
                starts.append(r)
            else:
                sessions.setdefault(r.session_id, []).append(r)
        self._successor: dict[Request, Request] = {}  # a turn → the session's next turn, until it is sent
        for turns in sessions.values():
            turns.sort(key=lambda r: r.turn)
            starts.append(turns[0])
            self._successor.update(pairwise(turns))
        self._starts = sorted(starts, key=lambda r: r.arrival_s)  # what arrives by the clock, in order
        self.max_concurrency = max_concurrency
        self.on_end = on_end
        self._next = 0
        self._in_flight = 0  # requests, or sessions, sent and not ended
        self._gate_open_s = 0.0  # when the concurrency cap last made room
        self._now_s = 0.0
        self._later: list[tuple[float, int, Request]] = []  # later turns released, by send time (a heap)
        self._unsent_turns = len(self._successor)  # later turns not yet released or ended
        self._order = count()  # breaks send-time ties in the heap by release order
        self._drain = stage_drain
        if stage_drain is not None:
            self._init_stages(stage_drain)

    def _init_stages(self, drain: StageDrain) -> None:
        if self._successor:
            raise ValueError("a trace with sessions has no load stages")
        # stage by stage: a stage's last requests may be drawn past the next one's nominal start (a Poisson count
        # short of rate x duration), and stages never overlap
        self._starts.sort(key=lambda r: (r.stage, r.arrival_s))
        stages = [r.stage for r in self._starts]
        if stages and (stages[0] < 0 or stages[-1] >= len(drain.origins)):
            raise ValueError(f"stage drain: request stages {stages[0]}..{stages[-1]}, the drain has "
                             f"{len(drain.origins)}")
        self._counted: set[Request] = set()  # requests whose end the stages have counted (each once)
        self._left = Counter(stages)  # each stage's requests not ended yet
        self._last_end: dict[int, float] = {}  # each stage's latest end so far
        self.stage_origins = [drain.origins[0]]  # the clock each stage started on, as the stages open
        self._open_stage = 0  # requests of later stages are held
        self._open_next()

    def _gated(self) -> bool:
        return self.max_concurrency is not None and self._in_flight >= self.max_concurrency

    def _held(self) -> bool:
        """The next request to send belongs to a stage that has not opened."""
        return self._drain is not None and self._starts[self._next].stage > self._open_stage

    def _open_next(self) -> None:
        """Open each stage whose previous stage's requests have all ended, moving its requests to its clock."""
        drain = self._drain
        assert drain is not None
        while self._open_stage + 1 < len(drain.origins) and not self._left[self._open_stage]:
            k = self._open_stage
            origin = drain.next_origin(self.stage_origins[k], self._last_end.get(k))
            shift = origin - drain.origins[k + 1]
            for r in self._starts[self._next:]:
                if r.stage != k + 1:
                    break
                r.arrival_s += shift
            self.stage_origins.append(origin)
            self._open_stage = k + 1

    def poll(self, now_s: float) -> list[Request]:
        self._now_s = now_s
        self._time_out(now_s)
        out = []
        while self._later and self._later[0][0] <= now_s:  # a session's next turn: its place is held
            out.append(heapq.heappop(self._later)[2])
        while self._next < len(self._starts) and not self._gated() and not self._held():
            r = self._starts[self._next]
            if r.arrival_s > now_s:
                break
            r.arrival_s = max(r.arrival_s, self._gate_open_s)
            out.append(r)
            self._next += 1
            self._in_flight += 1
        if self.request_timeout_s is not None:
            for r in out:
                deadline = client_deadline(r.arrival_s, self.request_timeout_s)
                heapq.heappush(self._deadlines, (deadline, next(self._order), r))
        return out

    def _time_out(self, now_s: float) -> None:
        """Abort every sent request whose client has given up on it by ``now_s``."""
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, _, r = heapq.heappop(self._deadlines)
            if not r.status.terminal:
                assert self._abort is not None
                self._abort(r, f"timeout: no complete response {self.request_timeout_s:g} s after it was sent")

    def next_arrival_s(self) -> float | None:
        later = self._later[0][0] if self._later else None
        while self._deadlines and self._deadlines[0][2].status.terminal:  # ended before its client gave up
            heapq.heappop(self._deadlines)
        if self._deadlines:  # a client giving up is an event the engine must see, as an arrival is
            later = self._deadlines[0][0] if later is None else min(later, self._deadlines[0][0])
        if self._next >= len(self._starts) or self._gated() or self._held():
            return later
        start = max(self._starts[self._next].arrival_s, self._gate_open_s)
        return start if later is None else min(start, later)

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._starts) and not self._later and self._unsent_turns == 0

    def on_finished(self, request: Request) -> None:
        nxt = self._successor.pop(request, None)
        if nxt is not None and request.status is Status.FINISHED:
            self._send_later(request, nxt)
        else:
            while nxt is not None:  # the session ends here: its later turns are never sent
                nxt.arrival_s = self._now_s  # when the client gave them up
                nxt.end(Status.REJECTED, f"{UNSENT} at turn {request.turn} ({request.status.value}: "
                                         f"{request.finish_reason})")
                self._unsent_turns -= 1
                if self.on_end is not None:
                    self.on_end(nxt)
                nxt = self._successor.pop(nxt, None)
            if self._gated():
                self._gate_open_s = self._now_s if request.finish_s is None else request.finish_s
            self._in_flight -= 1
        if self._drain is not None and request not in self._counted:
            self._counted.add(request)
            k = request.stage
            self._left[k] -= 1
            self._last_end[k] = max(self._last_end.get(k, -math.inf), end_s(request))
            self._open_next()
        if self.on_end is not None:
            self.on_end(request)

    def _send_later(self, turn: Request, nxt: Request) -> None:
        """Release the session's next turn: the history it carries, and when the client sends it."""
        history = np.concatenate([turn.prompt_token_ids, turn.output_tokens])
        nxt.prepend_history(history)
        assert turn.finish_s is not None
        nxt.arrival_s = turn.finish_s + nxt.turn_delay_s
        heapq.heappush(self._later, (nxt.arrival_s, next(self._order), nxt))
        self._unsent_turns -= 1
