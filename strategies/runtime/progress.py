"""The book of running requests' progress: per-slot host arrays owned by the runtime.

A request's progress — its counters (tokens computed, prefill target, samples in flight, outputs received), its
tokens (prompt and outputs) and its token times — always lives in a book of this shape, in one row: the slot's
row of the runtime's book while it holds a slot, the one row of a book of its own otherwise. ``Request`` reads
and writes them there through properties (a counter through ``Booked``), with no branch on where they are; it
moves the row into the slot's at admission and back when it lets the slot go (``request.py``; this module knows
no request, only an object with a ``book`` and a ``row``).
vLLM v1's ``InputBatch`` (``token_ids_cpu``, ``num_computed_tokens_cpu`` per request row) and TensorRT-LLM's
decoder state keep request progress the same way, so that the host's per-step work — the scheduler's
decode rows, the postprocess's token hand-out — is done over the book, as a few array operations over the
running slots at large batches, instead of request by request (docs/host-path.md has what that saves).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strategies.runtime.decoder.finish import CONTINUE

MIN_COLUMNS = 64  # first width of the token rows; they double as longer requests arrive
# From this many rows a step's hand-out is array operations over them; below, row by row is
# faster, as an array operation has a fixed cost however short its array (the crossing measured: docs/host-path.md)
MIN_ARRAY_ROWS = 24
# Columns of ``counters``: tokens whose KV is written or launched; tokens to prefill on this admission; samples
# scheduled (received or still on the device: in flight = SCHEDULED - OUTPUTS, so a token handed out moves one
# column); output tokens received (next to SCHEDULED: a token appended moves both as one slice); max_new_tokens;
# prompt length
COMPUTED, TARGET, SCHEDULED, OUTPUTS, MAX_NEW, PROMPT = range(6)


class SlotProgress:
    def __init__(self, num_slots: int, columns: int = MIN_COLUMNS, time_columns: int = MIN_COLUMNS) -> None:
        self.num_slots = num_slots
        self.counters = np.zeros((num_slots, 6), dtype=np.int64)  # [S, 6] the columns above
        # [S] 2 x tenure (admissions into the slot so far) + 1 while its holder runs (static keeps finished
        # requests' slots): a step's row is handed out here only if its slot's key is still the one it was
        # prepared with — not after a finish, a preemption or a new tenant
        self.key = np.zeros(num_slots, dtype=np.int64)
        self.holder = np.full(num_slots, None, dtype=object)  # [S] the request holding the slot, None if free
        self.tokens = np.zeros((num_slots, columns), dtype=np.int64)  # [S, C] prompt then outputs
        self.times = np.zeros((num_slots, time_columns), dtype=np.float64)  # [S, C'] when each output was received

    def take(self, slot: int, holder: object, counters: list[int], tokens: np.ndarray, times: np.ndarray,
             running: bool) -> None:
        """``holder`` takes ``slot`` with its ``counters`` (the six columns), ``tokens`` (prompt and outputs)
        and output ``times``."""
        holders = self.holder
        assert holders[slot] is None, f"slot {slot} is held"
        most = max(counters[MAX_NEW], counters[OUTPUTS])
        if counters[PROMPT] + most > self.tokens.shape[1] or most > self.times.shape[1]:
            self.fit(counters[PROMPT] + most, most)
        self.counters[slot] = counters
        self.tokens[slot, :len(tokens)] = tokens
        if len(times):  # (a first admission has none; writing even an empty one costs: docs/host-path.md)
            self.times[slot, :len(times)] = times
        key = self.key
        key[slot] = (key.item(slot) | 1) + 1 + running  # the next tenure (as ints: numpy scalars' sums cost)
        holders[slot] = holder

    def give_back(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The holder leaves ``slot``: its counters, output tokens and output times (views: copy them before the
        slot is taken again)."""
        c = self.counters[slot]
        self.key[slot] &= ~1
        self.holder[slot] = None
        prompt, outputs = c.item(PROMPT), c.item(OUTPUTS)
        return c, self.tokens[slot, prompt:prompt + outputs], self.times[slot, :outputs]

    def hand_out(self, slots: np.ndarray, keys: np.ndarray, out: np.ndarray, now: float) -> list[int]:
        """A step's outputs (``out [R, 2]`` token, finish code; the slot of each row and the key its holder had
        when the step was prepared, ``[R]`` each): the common case here — a row that continues a request
        still running in that tenure gets its token and time (as arrays from ``MIN_ARRAY_ROWS`` rows, row by
        row below). Returns the indices of the other rows (finishes, discarded rows, a request that left
        its slot meanwhile), for the strategy's loop."""
        if len(slots) >= MIN_ARRAY_ROWS:
            fast = out[:, 1] == CONTINUE  # [R]
            fast &= self.key[slots] == keys
            s = slots[fast]  # [F] distinct: a slot has one request, a request one row
            c = self.counters[s]  # [F, 6]
            k = c[:, OUTPUTS]  # [F]
            self.tokens[s, c[:, PROMPT] + k] = out[fast, 0]
            self.times[s, k] = now
            self.counters[s, OUTPUTS] = k + 1  # one sample less in flight: SCHEDULED stays
            return (~fast).nonzero()[0].tolist()  # (not np.flatnonzero: its wrapper costs, docs/host-path.md)
        rest = []
        counters, key, tokens, times = self.counters, self.key, self.tokens, self.times
        for i, (s, expected, (token, code)) in enumerate(zip(slots.tolist(), keys.tolist(), out.tolist(),
                                                           strict=True)):
            if code != CONTINUE or key.item(s) != expected:
                rest.append(i)
                continue
            k = counters.item(s, OUTPUTS)
            tokens[s, counters.item(s, PROMPT) + k] = token
            times[s, k] = now
            counters[s, OUTPUTS] = k + 1
        return rest

    def fit(self, columns: int, time_columns: int) -> None:
        """Widen the rows (doubling) where a request of ``columns`` tokens and ``time_columns`` outputs does not
        fit; rare (``take`` calls it only then), and never per step."""
        for name, need in (("tokens", columns), ("times", time_columns)):
            a = getattr(self, name)
            if need > a.shape[1]:
                wider = np.zeros((self.num_slots, max(need, 2 * a.shape[1])), dtype=a.dtype)
                wider[:, :a.shape[1]] = a
                setattr(self, name, wider)


class Booked:
    """A progress counter of a request (``request.py``): its column in the request's ``book`` at its ``row`` —
    the slot's row of the runtime's book while it holds a slot, its own one-row book's otherwise."""

    def __init__(self, column: int) -> None:
        self.column = column

    def __get__(self, r: Any, owner: type | None = None) -> Any:
        if r is None:
            return self
        return r.book.counters.item(r.row, self.column)

    def __set__(self, r: Any, value: int) -> None:
        r.book.counters[r.row, self.column] = value
