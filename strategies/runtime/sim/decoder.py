"""The simulated device's decoder state: each step's tokens and finish codes, where nothing is computed.

On ``--device sim`` token values carry no meaning, so the simulated device does not run the sampler or a
stand-in forward (they were a third of a simulated step's real time). Each step writes, for every output
row, a token drawn by a cheap rule — a hash of the request's seed and how many tokens it has generated, so
deterministic per seed and independent of the batch around it — and the finish code the real decoder state
(``decoder/state.py``) would write for it: a stop id (EOS unless ``ignore_eos``, or one of the request's own)
ends the request with STOP, its ``max_new_tokens``-th token with LENGTH, and a row of a request the device
already finished is DISCARDED (overlap's one extra step, static's padding rows). Per-slot numpy arrays,
admitted from the same step inputs the real decoder state reads (``StepIO.admit``).

Speculative decoding (``accept``): a verifying row's target tokens are the same rule's at the steps it
covers, so a request receives the tokens a run without speculation gives it, only in fewer steps; how
many drafts it keeps is forced, as TensorRT-LLM's testing knob does: draft j is accepted with probability
``acceptance_rate`` if every draft before it was (a draw hashed from the seed and step, so reproducible).
"""

from __future__ import annotations

import numpy as np

from strategies.runtime.buffers.step_io import ADMIT_INTS
from strategies.runtime.decoder.finish import CONTINUE, DISCARDED, LENGTH, STOP

_MUL, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x9E3779B97F4A7C15)
_S30, _S31 = np.uint64(30), np.uint64(31)
_MUL2, _S27 = np.uint64(0x94D049BB133111EB), np.uint64(27)
assert (CONTINUE, STOP) == (0, 1), "SimDecoder.step reads a row's stop-id match (a bool) as its finish code"


def sim_tokens(seeds: np.ndarray, steps: np.ndarray, vocab: int) -> np.ndarray:
    """One token per row: a splitmix64-style mix of (seed, step) (uint64 arrays, [R] each: integer arrays
    wrap silently, so no ``errstate``, whose cost is in docs/host-path.md), reduced to the vocabulary."""
    x = seeds * _GOLDEN  # [R]
    x += steps
    x ^= x >> _S30
    x *= _MUL
    x ^= x >> _S31
    x %= np.uint64(vocab)
    return x.view(np.int64)


def unit_draws(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) per (seed, step) (uint64 arrays of one shape): splitmix64's whole finaliser, as
    acceptance draws at neighbouring steps must not correlate (``sim_tokens``' one round leaves them so)."""
    with np.errstate(over="ignore"):
        x = (seeds + np.uint64(1)) * _GOLDEN + steps * _MUL  # distinct streams per seed
        x ^= x >> _S30
        x *= _MUL
        x ^= x >> _S27
        x *= _MUL2
        x ^= x >> _S31
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class SimDecoder:
    def __init__(self, num_slots: int, max_stop_ids: int, vocab: int) -> None:
        self.vocab = vocab
        self.gen_len = np.zeros(num_slots, dtype=np.uint64)  # [S] tokens generated so far
        self.max_new = np.zeros(num_slots, dtype=np.uint64)  # [S]
        self.seed = np.zeros(num_slots, dtype=np.uint64)  # [S]
        self.stop_ids = np.full((num_slots, max_stop_ids), -1, dtype=np.int64)  # [S, M] -1 = unused, packed left
        # Columns of ``stop_ids`` any admission has used: a step compares only those (none under --ignore-eos
        # without stop ids: the comparison was ~40% of a 235-row step); they only grow, so no slot's stop id
        # is ever past them
        self.stop_width = 0
        self.finished = np.zeros(num_slots, dtype=bool)  # [S]

    def admit(self, rows: np.ndarray) -> None:
        """``rows [A, ADMIT_INTS + M]``: StepIO's admission rows (slot, tokens so far, max new, seed, ...,
        stop ids)."""
        slots, stops = rows[:, 0], rows[:, ADMIT_INTS:]  # [A], [A, M]
        self.gen_len[slots], self.max_new[slots], self.seed[slots] = rows[:, 1], rows[:, 2], rows[:, 3]
        self.stop_ids[slots] = stops
        self.finished[slots] = False
        w = self.stop_width
        # (a list: most admissions are one row, where an array reduction costs more: docs/host-path.md)
        if w < stops.shape[1] and max(stops[:, w].tolist()) >= 0:  # a row with more stop ids than any before
            self.stop_width = int((stops != -1).sum(axis=1).max())

    def step(self, slots: np.ndarray, out: np.ndarray) -> None:
        """One token and finish code per row of ``slots [R]`` (a request once, beams or not) into ``out [R, 2]``.
        Few array operations: each has a fixed cost however short the array, and most steps have few rows."""
        finished = self.finished[slots]  # [R]
        gen = self.gen_len[slots]  # [R]
        tokens = sim_tokens(self.seed[slots], gen, self.vocab)  # [R]
        gen += ~finished
        w = self.stop_width
        if w == 0:
            code = np.zeros(len(slots), dtype=np.int8)  # [R] CONTINUE
        elif w == 1:  # EOS alone (or one stop id)
            code = (self.stop_ids[slots, 0] == tokens).view(np.int8)  # [R] STOP 1 / CONTINUE 0
        else:
            code = (self.stop_ids[slots, :w] == tokens[:, None]).any(axis=1).view(np.int8)  # [R]
        code[(code == 0) & (gen >= self.max_new[slots])] = LENGTH  # a stop id at the last token is a stop
        code[finished] = DISCARDED
        self.gen_len[slots] = gen
        self.finished[slots] = code != CONTINUE
        out[:, 0] = tokens
        out[:, 1] = code

    def accept(self, slots: np.ndarray, num_drafts: np.ndarray, rate: float, out: np.ndarray) -> None:
        """Verify each row of ``slots [R]`` (``num_drafts [R]`` each, at most K) into ``out [R, K + 4]``: the
        K + 1 target tokens, tokens received, finish code, drafts received — DraftTokens' layout and the
        finish rules of the real accept step (``decoder/accept.py``)."""
        r, k1 = len(slots), out.shape[1] - 3
        active = ~self.finished[slots]  # [R]
        gen = self.gen_len[slots]  # [R]
        steps = gen[:, None] + np.arange(k1, dtype=np.uint64)  # [R, K + 1]
        seeds = np.broadcast_to(self.seed[slots, None], steps.shape)  # [R, K + 1]
        target = sim_tokens(seeds.ravel(), steps.ravel(), self.vocab).reshape(r, k1)  # [R, K + 1]
        u = unit_draws(seeds[:, :-1], steps[:, :-1])  # [R, K] draft j's draw, at step gen + j
        keep = (u < rate) & (np.arange(k1 - 1) < num_drafts[:, None])  # [R, K]
        accepted = np.cumprod(keep, axis=1).sum(axis=1)  # [R] leading accepted drafts
        candidate = np.arange(k1) <= accepted[:, None]  # [R, K + 1]
        stops = self.stop_ids[slots, :self.stop_width]  # [R, w] the columns in use, as in ``step``
        is_stop = (stops[:, None, :] == target[:, :, None]).any(axis=2) & candidate  # [R, K + 1]
        first_stop = np.where(is_stop.any(axis=1), is_stop.argmax(axis=1), k1)  # [R]
        room = (self.max_new[slots] - gen).astype(np.int64)  # [R]
        n = np.where(active, np.minimum(np.minimum(accepted + 1, first_stop + 1), room), 0)  # [R]
        hit_stop = active & (first_stop < n)
        hit_len = active & ~hit_stop & (n >= room)
        self.gen_len[slots] = gen + n.astype(np.uint64)
        self.finished[slots] |= hit_stop | hit_len
        out[:, :k1] = target
        out[:, k1] = n
        out[:, k1 + 1] = np.where(active, hit_len * 2 + hit_stop, DISCARDED)
        out[:, k1 + 2] = np.minimum(accepted, np.maximum(n - 1, 0))
