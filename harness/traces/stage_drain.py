"""inference-perf's move from one load stage to the next, which a replay's source follows (``harness/source.py``).

Its load generator never starts a stage while a request of the one before still runs (``load_generator.py``, from
the measured runs' build of late 2025 to February 2026):
- the multi-process loop (any ``num_workers`` > 0, its default) starts stage k's clock T_k one second after the stage
  begins (``start_time = perf_counter() + 1``: the workers get the queue first) and sends the stage's requests at
  T_k plus their gaps. From T_k - 1 it checks once a second whether every one of them has ended (finished, failed or
  timed out); the first check that finds them all ended closes the stage, and ``load.interval`` seconds later the
  next begins: T_{k+1} = that check + interval + 1;
- the single-process loop (``num_workers: 0``) waits for its requests' tasks, then ``interval``:
  T_{k+1} = the last end + interval.

So under the multi-process loop the next stage's clock starts 2-3 s after the last request of the one before
ended, not at the nominal end of its duration. A stage's requests keep the gaps they were drawn with: the source
moves the whole stage to its clock when it opens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

MULTI_PROCESS_LEAD_S = 1.0  # the multi-process loop's first request time is T_k = the stage's start + 1 s
MULTI_PROCESS_POLL_S = 1.0  # and it checks once a second whether the stage's requests have all ended


@dataclass(frozen=True)
class StageDrain:
    origins: tuple[float, ...]  # each stage's clock start as the trace was drawn (back to back: 0, d0, d0 + d1, ...)
    interval_s: float = 1.0  # load.interval: slept between a stage's close and the next stage's start
    poll_s: float = MULTI_PROCESS_POLL_S  # how often the close is checked (0: at the last end itself)
    lead_s: float = MULTI_PROCESS_LEAD_S  # a stage's clock starts this long after the stage does

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.poll_s < 0 or self.lead_s < 0:
            raise ValueError(f"stage drain: interval, poll and lead must be >= 0, got {self}")
        if any(b < a for a, b in pairwise(self.origins)):
            raise ValueError(f"stage drain: stage origins must not decrease, got {self.origins}")

    @classmethod
    def of_loop(cls, origins: tuple[float, ...], interval_s: float, multi_process: bool) -> StageDrain:
        """The drain of inference-perf's multi-process loop (``num_workers`` > 0) or its single-process one."""
        if multi_process:
            return cls(origins, interval_s)
        return cls(origins, interval_s, poll_s=0.0, lead_s=0.0)

    def next_origin(self, origin: float, last_end: float | None) -> float:
        """Stage k + 1's clock start, from stage k's (``origin``) and when its last request ended (None: it had
        none, so its first check closes it)."""
        first_check = origin - self.lead_s
        if last_end is None or last_end <= first_check:
            closed = first_check
        elif self.poll_s:
            closed = first_check + math.ceil((last_end - first_check) / self.poll_s) * self.poll_s
        else:
            closed = last_end
        return closed + self.interval_s + self.lead_s
