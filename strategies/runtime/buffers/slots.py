"""Request slots: a fixed pool of row indices into every per-slot tensor.

A slot is what a running request *is* to the device: its row in the decoder state and its region of
the KV cache. It is taken at admission and returned at finish (or preemption); in between no other
request can hold it. The pool is a free list, so taking and returning are O(1) and allocate nothing.
"""

from __future__ import annotations


class SlotsExhausted(RuntimeError):
    pass


class SlotManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        # Reversed so that slot 0 is handed out first: timelines read more naturally.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def owner(self, slot: int) -> str | None:
        return self._owner[slot]

    def acquire(self, owner: str) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} slots are in use; cannot admit {owner!r}")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def release(self, slot: int, owner: str) -> None:
        if self._owner[slot] != owner:
            raise RuntimeError(f"slot {slot} is held by {self._owner[slot]!r}, not {owner!r}")
        self._owner[slot] = None
        self._free.append(slot)
