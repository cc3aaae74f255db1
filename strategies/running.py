"""A strategy's running requests, in admission order, with their slots in an array beside them.

The scheduler picks a step's decode rows by array operations over the running requests' slots
(``scheduler._decode_rows``). Reading ``r.slot`` from each of a few hundred requests every step is slow — by
then the requests' objects are out of the core's caches (docs/host-path.md) — so the list writes a request's
slot beside it when it is appended instead. A request takes no other slot while it is in
the list: a new one only after it was removed (preempted, or handed off by a prefill worker), appended again.

Only ``append``, ``remove`` (or ``discard``) and ``clear`` change it (the strategies use nothing else); every
other mutator raises, so that the slots can never drift from the requests. ``select`` makes a new list of some
of them (a pipeline's requests not in flight), slots included.
"""

from __future__ import annotations

import operator
from typing import NoReturn

import numpy as np

from strategies.runtime.request import Request


class RunningRequests(list):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._slots = np.empty(capacity, dtype=np.int64)  # [capacity] the slot of each request, in list order

    @property
    def slots(self) -> np.ndarray:
        """[N] each request's slot, in list order (a view: read it before the list changes)."""
        return self._slots[:len(self)]

    def append(self, r: Request) -> None:
        assert r.slot is not None, "a running request holds a slot"
        self._slots[len(self)] = r.slot
        super().append(r)

    def remove(self, r: Request) -> None:
        self._remove_at(self.index(r))  # by identity: a request compares equal to itself only

    def discard(self, r: Request) -> None:
        """Remove ``r`` if it is here: one scan, where a membership test and then ``remove`` take two. By
        ``operator.indexOf``: a miss of ``list.index`` formats the request's repr, prompt array and all, into
        its error message (a release misses once a finish)."""
        try:
            i = operator.indexOf(self, r)
        except ValueError:
            return
        self._remove_at(i)

    def _remove_at(self, i: int) -> None:
        n = len(self)
        self._slots[i:n - 1] = self._slots[i + 1:n]
        super().__delitem__(i)

    def select(self, keep: list[bool], limit: int) -> RunningRequests:
        """A new list of the first ``limit`` requests where ``keep`` [N] is true, in order, their slots copied
        from this one's array (a pipeline's idle requests: removing one from it leaves this list as it is)."""
        rows = np.flatnonzero(keep)[:limit]  # [M]
        out = RunningRequests(len(self._slots))
        list.extend(out, [self[i] for i in rows.tolist()])
        out._slots[:len(rows)] = self._slots[rows]
        return out

    def _fixed(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("RunningRequests changes only by append, remove and clear (its slots follow them)")

    insert = pop = extend = sort = reverse = __setitem__ = __delitem__ = __iadd__ = __imul__ = _fixed
