"""The running list's slots array (``strategies/running.py``) against the requests' own slots."""

import random

import numpy as np
import pytest

from strategies.running import RunningRequests
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams


def _request(i: int, slot: int) -> Request:
    r = Request(f"r{i}", np.array([1, 2, 3]), 4, SamplingParams())
    r.slot = slot
    return r


def test_the_slots_follow_appends_and_removes_anywhere_in_the_list():
    """2,000 random appends (a free slot each), removes (any position: finishes, preemptions), discards (of a
    request there or not) and clears: after each, ``slots`` equals the slot read from every request in list
    order."""
    rng = random.Random(0)
    running, free, made = RunningRequests(16), list(range(16)), 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.5 and free:
            r = _request(made, free.pop(rng.randrange(len(free))))
            made += 1
            running.append(r)
        elif op < 0.9 and running:
            r = rng.choice(running)
            running.remove(r)
            free.append(r.slot)
        elif op < 0.98 and running:  # discard: a request in the list, or one that is not (nothing changes)
            r = rng.choice(running) if op < 0.95 else _request(-1, 99)
            before = list(running)
            running.discard(r)
            assert list(running) == [x for x in before if x is not r]
            if r.slot != 99:
                free.append(r.slot)
        elif op >= 0.98:
            free += [r.slot for r in running]
            running.clear()
        assert running.slots.tolist() == [r.slot for r in running]
    assert made > 500


def test_only_append_remove_and_clear_change_it():
    running = RunningRequests(4)
    a, b = _request(0, 2), _request(1, 0)
    running.append(a)
    running.append(b)
    for change in (lambda: running.insert(0, b), lambda: running.pop(), lambda: running.extend([a]),
                   lambda: running.sort(key=id), running.reverse, lambda: running.__setitem__(0, b),
                   lambda: running.__delitem__(0), lambda: running.__iadd__([a])):
        with pytest.raises(TypeError, match="append, remove and clear"):
            change()
    assert list(running) == [a, b] and running.slots.tolist() == [2, 0]
    running.remove(a)
    assert list(running) == [b] and running.slots.tolist() == [0]


def test_a_selection_carries_its_slots_and_leaves_the_list_alone():
    """A pipeline's idle requests: the first ``limit`` kept, slots copied from the array; removing one from
    the selection (a preemption victim) changes neither the list nor its slots."""
    running = RunningRequests(8)
    reqs = [_request(i, slot) for i, slot in enumerate([5, 2, 7, 0, 3])]
    for r in reqs:
        running.append(r)
    idle = running.select([True, False, True, True, True], 3)
    assert list(idle) == [reqs[0], reqs[2], reqs[3]] and idle.slots.tolist() == [5, 7, 0]
    idle.remove(reqs[2])
    assert list(idle) == [reqs[0], reqs[3]] and idle.slots.tolist() == [5, 0]
    assert list(running) == reqs and running.slots.tolist() == [5, 2, 7, 0, 3]
    assert running.select([False] * 5, 3) == [] and running.select([False] * 5, 3).slots.shape == (0,)


def test_discarding_an_absent_request_never_formats_it(monkeypatch):
    """A release discards a request from lists it may not be in; list.index's miss would put the request's
    repr, prompt array and all, into its error message (a third of a 575-token-prompt replay's time)."""
    running = RunningRequests(4)
    here, absent = _request(0, 0), _request(1, 1)
    running.append(here)

    def refuse(self):
        raise AssertionError("repr formatted")

    monkeypatch.setattr(Request, "__repr__", refuse)
    running.discard(absent)
    assert list(running) == [here]
    running.discard(here)
    assert list(running) == []
