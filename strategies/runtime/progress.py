"""The book of running requests' progress: per-slot host arrays owned by the runtime.

While a request holds a slot, its counters (tokens computed, prefill target, samples in flight, outputs
received), its tokens (prompt and outputs) and its token times live here, in the slot's row, and nowhere
else: ``Request`` reads and writes them through properties, moves its values into the slot's row at
admission and takes them back when it lets the slot go (``request.py``; this module knows no request).
vLLM v1's ``InputBatch`` (``token_ids_cpu``, ``num_computed_tokens_cpu`` per request row) and TensorRT-LLM's
decoder state keep request progress the same way, so that the host's per-step work — the scheduler's
decode rows, the postprocess's token hand-out — is a few array operations over the running slots rather
than a Python loop over requests (issue 27: at batch ~250 those loops were most of a simulated step's
host time).
"""

from __future__ import annotations

import numpy as np

from strategies.runtime.decoder.state import CONTINUE

MIN_COLUMNS = 64  # first width of the token rows; they double as longer requests arrive
# Fewer rows than this are faster request by request: an array operation costs ~1 us however short its array,
# and a step's hand-out or decode choice is ~20 of them (measured: at batch <= 5 the arrays doubled a simulated
# step's host time; at ~250 they took it from 0.46 to 0.36 ms)
MIN_ARRAY_ROWS = 16


class SlotProgress:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.computed = np.zeros(num_slots, dtype=np.int64)  # [S] tokens whose KV is written or launched
        self.target = np.zeros(num_slots, dtype=np.int64)  # [S] tokens to prefill on this admission
        self.pending = np.zeros(num_slots, dtype=np.int64)  # [S] samples launched, not yet read by the host
        self.outputs = np.zeros(num_slots, dtype=np.int64)  # [S] output tokens received
        self.max_new = np.zeros(num_slots, dtype=np.int64)  # [S] the request's max_new_tokens
        self.prompt_len = np.zeros(num_slots, dtype=np.int64)  # [S]
        self.live = np.zeros(num_slots, dtype=bool)  # [S] held by a RUNNING request (static keeps finished ones)
        self.holder = np.full(num_slots, None, dtype=object)  # [S] the request holding the slot, None if free
        # [S] admissions into the slot so far: a step's row whose slot has been taken again since it was
        # scheduled (overlap: finished, or preempted, meanwhile) is told apart from the new tenure's
        self.tenure = np.zeros(num_slots, dtype=np.int64)
        self.tokens = np.zeros((num_slots, MIN_COLUMNS), dtype=np.int64)  # [S, C] prompt then outputs
        self.times = np.zeros((num_slots, MIN_COLUMNS), dtype=np.float64)  # [S, C'] when each output was received

    def hand_out(self, slots: np.ndarray, tenures: np.ndarray, out: np.ndarray, now: float) -> np.ndarray:
        """A step's outputs (``out [R, 2]`` token, finish code; the slot of each row and the slot's tenure when
        the step was prepared, ``[R]`` each): the common case at once — a row that continues a running
        request in the tenure that asked for it gets its token and time. Returns the indices of the other
        rows (finishes, discarded rows, a request that left its slot meanwhile), for the strategy's loop.
        Below ``MIN_ARRAY_ROWS`` rows that loop takes them all."""
        if len(slots) < MIN_ARRAY_ROWS:
            return np.arange(len(slots))
        fast = out[:, 1] == CONTINUE  # [R]
        fast &= self.live[slots]
        fast &= self.tenure[slots] == tenures
        s = slots[fast]  # [F] distinct: a slot has one request, a request one row
        self.pending[s] -= 1
        k = self.outputs[s]  # [F]
        self.tokens[s, self.prompt_len[s] + k] = out[fast, 0]
        self.times[s, k] = now
        self.outputs[s] = k + 1
        return np.flatnonzero(~fast)

    def fit(self, columns: int, time_columns: int) -> None:
        """Widen the rows (doubling) so that a request of ``columns`` tokens fits; rare, and never per step."""
        for name, need in (("tokens", columns), ("times", time_columns)):
            a = getattr(self, name)
            if need > a.shape[1]:
                wider = np.zeros((self.num_slots, max(need, 2 * a.shape[1])), dtype=a.dtype)
                wider[:, :a.shape[1]] = a
                setattr(self, name, wider)
