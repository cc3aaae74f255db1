"""The simulated device's decoder state: each step's tokens and finish codes, where nothing is computed.

On ``--device sim`` token values carry no meaning, so the simulated device does not run the sampler or a
stand-in forward (they were a third of a simulated step's real time). Each step writes, for every output
row, a token drawn by a cheap rule — a hash of the request's seed and how many tokens it has generated, so
deterministic per seed and independent of the batch around it — and the finish code the real decoder state
(``decoder/state.py``) would write for it: a stop id (EOS unless ``ignore_eos``, or one of the request's own)
ends the request with STOP, its ``max_new_tokens``-th token with LENGTH, and a row of a request the device
already finished is DISCARDED (overlap's one extra step, static's padding rows). Per-slot numpy arrays,
admitted from the same step inputs the real decoder state reads (``StepIO.admit``).
"""

from __future__ import annotations

import numpy as np

from strategies.runtime.buffers.step_io import ADMIT_INTS
from strategies.runtime.decoder.state import DISCARDED

_MUL, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x9E3779B97F4A7C15)
_S30, _S31 = np.uint64(30), np.uint64(31)


def sim_tokens(seeds: np.ndarray, steps: np.ndarray, vocab: int) -> np.ndarray:
    """One token per row: a splitmix64-style mix of (seed, step) (uint64 arrays, [R] each), reduced to
    the vocabulary."""
    with np.errstate(over="ignore"):
        x = seeds * _GOLDEN + steps  # [R]
        x ^= x >> _S30
        x *= _MUL
        x ^= x >> _S31
    return (x % np.uint64(vocab)).view(np.int64)


class SimDecoder:
    def __init__(self, num_slots: int, max_stop_ids: int, vocab: int) -> None:
        self.vocab = vocab
        self.gen_len = np.zeros(num_slots, dtype=np.uint64)  # [S] tokens generated so far
        self.max_new = np.zeros(num_slots, dtype=np.uint64)  # [S]
        self.seed = np.zeros(num_slots, dtype=np.uint64)  # [S]
        self.stop_ids = np.full((num_slots, max_stop_ids), -1, dtype=np.int64)  # [S, M] -1 = unused
        self.finished = np.zeros(num_slots, dtype=bool)  # [S]

    def admit(self, rows: np.ndarray) -> None:
        """``rows [A, ADMIT_INTS + M]``: StepIO's admission rows (slot, tokens so far, max new, seed, ...,
        stop ids)."""
        slots = rows[:, 0]
        self.gen_len[slots], self.max_new[slots], self.seed[slots] = rows[:, 1], rows[:, 2], rows[:, 3]
        self.stop_ids[slots] = rows[:, ADMIT_INTS:]
        self.finished[slots] = False

    def step(self, slots: np.ndarray, out: np.ndarray) -> None:
        """One token and finish code per row of ``slots [R]`` (a request once, beams or not) into ``out [R, 2]``."""
        active = ~self.finished[slots]  # [R]
        gen = self.gen_len[slots]  # [R]
        tokens = sim_tokens(self.seed[slots], gen, self.vocab)  # [R]
        gen += active
        hit_stop = (self.stop_ids[slots] == tokens[:, None]).any(axis=1)  # [R]
        hit_stop &= active
        hit_len = gen >= self.max_new[slots]  # [R]
        hit_len &= active
        hit_len &= ~hit_stop
        self.gen_len[slots] = gen
        self.finished[slots] = ~active | hit_stop | hit_len
        out[:, 0] = tokens
        out[:, 1] = hit_len.view(np.uint8) * np.uint8(2) + hit_stop.view(np.uint8)  # STOP 1 / LENGTH 2 / CONTINUE 0
        out[~active, 1] = DISCARDED
