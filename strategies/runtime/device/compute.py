"""How much of the CPU a strategy gets: torch's intra-op threads and the interpreter's switch interval.

Both are process-wide, so whatever one strategy sets would otherwise leak into the next (a peer run
after slotbench's stream would inherit its thread count, or torch's default of every core). The runner
gives each strategy the same budget and puts the process back as it found it afterwards.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def machine_threads() -> int:
    """Every CPU this process may run on (its affinity mask, not the machine's core count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_threads(threads: int) -> int:
    """``--device-threads``: a positive count as given; 0 is the whole machine."""
    return threads if threads > 0 else machine_threads()


@contextmanager
def compute_budget(threads: int, switch_interval_s: float | None = None) -> Iterator[int]:
    """Run the block with ``resolve_threads(threads)`` torch threads (and a switch interval, if given);
    yields the thread count; restores both on the way out, also after an exception."""
    import torch  # here, not above: the thread helpers above serve processes that never import torch

    old_threads, old_interval = torch.get_num_threads(), sys.getswitchinterval()
    n = resolve_threads(threads)
    torch.set_num_threads(n)
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    try:
        yield n
    finally:
        torch.set_num_threads(old_threads)
        sys.setswitchinterval(old_interval)
