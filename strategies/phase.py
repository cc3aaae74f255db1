"""A host phase of a step (schedule, prepare, postprocess): timed into the step's record and marked with one
NVTX range, as ``with strategy._phase(rec, "schedule"):``.

A class with ``__enter__``/``__exit__`` rather than a generator under ``contextlib.contextmanager``: that
machinery (a generator and a context-manager object a phase, two resumptions) is paid three times a step,
part of it inside the host time a phase measures (docs/host-path.md). One object serves every phase
of its strategy, in turn: phases never nest (the NVTX rule: one range per phase, never stacked twice).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strategies.runtime.device.clock import Clock
    from strategies.runtime.device.nvtx import Nvtx
    from strategies.runtime.iteration import IterationRecord


class PhaseOwner(Protocol):
    """What a phase reads of its strategy (``strategies/base.py``: Strategy)."""

    nvtx: Nvtx
    clock: Clock
    running: Sized


class HostPhase:
    __slots__ = ("_name", "_owner", "_rec", "_start")

    def __init__(self, owner: PhaseOwner) -> None:
        self._owner = owner  # its clock, NVTX and running requests, read when a phase starts and ends
        self._rec: IterationRecord | None = None  # the phase under way, None between phases
        self._name = ""
        self._start = 0.0

    def __call__(self, rec: IterationRecord, name: str) -> HostPhase:
        assert self._rec is None, f"host phase {name} inside {self._name}: phases do not nest"
        self._rec, self._name = rec, name
        return self

    def __enter__(self) -> None:
        owner = self._owner
        owner.nvtx.push(self._name)
        self._start = owner.clock.now()

    def __exit__(self, *exc: object) -> None:
        owner, rec, name = self._owner, self._rec, self._name
        self._rec = None
        try:
            owner.clock.charge_host(name, len(owner.running))
            setattr(rec, f"{name}_start_s", self._start)
            setattr(rec, f"{name}_end_s", owner.clock.now())
        finally:
            owner.nvtx.pop()
