"""Request slots: a fixed pool of row indices into every per-slot tensor.

A slot is what a running request *is* to the device: its row in the decoder state and its region of
the KV cache. It is taken at admission and returned at finish (or preemption); in between no other
request can hold it. The pool is a free list, so taking and returning are O(1) and allocate nothing.

The manager also keeps the book of who held which slot when (``tenures``, the report's slot occupancy
figure): one record per admission, written at the three events of a tenure only — never per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass


class SlotsExhausted(RuntimeError):
    pass


@dataclass(slots=True)
class SlotTenure:
    """One request's hold on one slot: from admission to release (a preempted request resumes with a new
    tenure). Iterations are the strategy's step numbers (IterationRecord.iteration)."""

    request_id: str
    slot: int
    width: int  # beams the request runs in its slot (1: no beam search)
    start_iteration: int  # the first step that computes it (the step whose schedule admitted it)
    decode_iteration: int = -1  # the first step after its prefill's last chunk (-1: the prefill never ended)
    end_iteration: int = -1  # the last step that computed a row of it before release (-1: still held)
    end: str = "running"  # finished | preempted | running (held at the end) | handed off | cancelled | aborted
    worker: str = ""  # disaggregated serving: whose slot (prefill0, decode1, ...)


class SlotManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        # Reversed so that slot 0 is handed out first: timelines read more naturally.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_slots
        self._open: list[SlotTenure | None] = [None] * num_slots  # each held slot's current tenure
        self.tenures: list[SlotTenure] = []  # every tenure, in admission order

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def owner(self, slot: int) -> str | None:
        return self._owner[slot]

    def acquire(self, owner: str, iteration: int = -1, width: int = 1) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} slots are in use; cannot admit {owner!r}")
        slot = self._free.pop()
        self._owner[slot] = owner
        self._open[slot] = tenure = SlotTenure(owner, slot, width, iteration)
        self.tenures.append(tenure)
        return slot

    def prefilled(self, slot: int, iteration: int) -> None:
        """The prefill's last chunk runs at ``iteration``: the slot decodes from the next step."""
        tenure = self._open[slot]
        if tenure is not None and tenure.decode_iteration < 0:
            tenure.decode_iteration = iteration + 1

    def release(self, slot: int, owner: str, last_iteration: int = -1, end: str = "finished") -> None:
        if self._owner[slot] != owner:
            raise RuntimeError(f"slot {slot} is held by {self._owner[slot]!r}, not {owner!r}")
        tenure = self._open[slot]
        if tenure is not None:
            tenure.end_iteration, tenure.end = last_iteration, end
            self._open[slot] = None
        self._owner[slot] = None
        self._free.append(slot)

    def take_closed(self) -> list[SlotTenure]:
        """The tenures that have ended, taken out of ``tenures`` (the held ones stay, in admission order)."""
        held = {id(t) for t in self._open if t is not None}
        out = [t for t in self.tenures if id(t) not in held]
        self.tenures = [t for t in self.tenures if id(t) in held]
        return out

    def close_open(self, last_iteration: int) -> None:
        """The run stopped: tenures still held end at ``last_iteration``, marked running."""
        for tenure in self._open:
            if tenure is not None:
                tenure.end_iteration = last_iteration
