"""Multi-turn sessions in a trace: a file's, checked and ordered; synthetic ones, with AIPerf's options.

A session is turns 0, 1, … sharing a ``session_id``. Turn 0 arrives at its ``arrival_s``; turn k > 0 is
sent ``delay_s`` after turn k - 1's last token (harness/source.py does that at run time). In a trace,
a later turn's ``arrival_s`` is its session's first arrival: a placeholder that keeps the session's
turns together, in order, through sorting, ``--start-offset`` and ``--limit``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from harness.errors import TraceError, UserError
from harness.traces.trace import TraceRequest


@dataclass(frozen=True)
class SessionShape:
    """Synthetic sessions, as AIPerf draws them: turns and think times normal around their means."""

    turns_mean: float = 1.0  # turns per session (--session-turns-mean), rounded, at least 1
    turns_stddev: float = 0.0  # --session-turns-stddev
    delay_mean_ms: float = 0.0  # think time before each later turn, ms (--session-turn-delay-mean)
    delay_stddev_ms: float = 0.0  # --session-turn-delay-stddev; a draw below 0 is 0

    def __post_init__(self) -> None:
        if not 1 <= self.turns_mean < math.inf:
            raise UserError(f"--session-turns-mean must be >= 1, got {self.turns_mean}")
        for name in ("turns_stddev", "delay_mean_ms", "delay_stddev_ms"):
            v = getattr(self, name)
            if not 0 <= v < math.inf:
                flag = {"turns_stddev": "turns-stddev", "delay_mean_ms": "turn-delay-mean",
                        "delay_stddev_ms": "turn-delay-stddev"}[name]
                raise UserError(f"--session-{flag} must be >= 0, got {v}")

    @property
    def multi_turn(self) -> bool:
        return self.turns_mean > 1 or self.turns_stddev > 0


def session_turns(num_requests: int, shape: SessionShape, seed: int) -> np.ndarray:
    """Turns of each session, drawn until they add up to ``num_requests`` (the last session is cut)."""
    rng = np.random.default_rng([seed, 0x5E5510])  # its own stream: the single-turn draws stay as they were
    counts: list[int] = []
    left = num_requests
    while left > 0:
        k = max(1, round(float(rng.normal(shape.turns_mean, shape.turns_stddev))))
        counts.append(min(k, left))
        left -= counts[-1]
    return np.array(counts, dtype=np.int64)


def as_sessions(reqs: list[TraceRequest], counts: np.ndarray, shape: SessionShape, seed: int) -> list[TraceRequest]:
    """Consecutive requests grouped into sessions of ``counts`` turns, each at its session's arrival (the
    first turn's); a later turn keeps its own length and no shared prefix (its history opens it)."""
    rng = np.random.default_rng([seed, 0xDE1A7])
    out = []
    i = 0
    for s, k in enumerate(counts):
        for turn in range(int(k)):
            r = reqs[i + turn]
            if turn and r.prefix_ids:
                r = replace(r, input_tokens=r.input_tokens - r.prefix_block_len, prefix_ids=None, prefix_block_len=0)
            delay = max(0.0, float(rng.normal(shape.delay_mean_ms, shape.delay_stddev_ms))) / 1e3 if turn else 0.0
            out.append(replace(r, arrival_s=reqs[i].arrival_s, session_id=f"session-{s}", turn=turn, delay_s=delay))
        i += int(k)
    return out


def arrange_sessions(path: str, rows: list[tuple[int, TraceRequest]]) -> list[TraceRequest]:
    """A file's (line, request) rows in file order, each session's later turns moved right after its
    turn 0 and given its arrival. A duplicate turn or a turn whose predecessor is missing names its line."""
    sessions: dict[str, dict[int, tuple[int, TraceRequest]]] = {}
    for line, r in rows:
        if r.session_id is None:
            continue
        turns = sessions.setdefault(r.session_id, {})
        if r.turn in turns:
            raise TraceError(path, line, f"session {r.session_id!r}: turn {r.turn} again (first on line "
                                         f"{turns[r.turn][0]})")
        turns[r.turn] = (line, r)
    for sid, turns in sessions.items():
        missing = next(k for k in range(len(turns) + 1) if k not in turns)
        if missing < len(turns):
            after = min(k for k in turns if k > missing)
            raise TraceError(path, turns[after][0], f"session {sid!r}: turn {after} without turn {missing}")
    out = []
    for _, r in rows:
        if r.session_id is None:
            out.append(r)
        elif r.turn == 0:
            turns = sessions[r.session_id]
            out.append(r)
            out.extend(replace(turns[k][1], arrival_s=r.arrival_s) for k in range(1, len(turns)))
    return out
