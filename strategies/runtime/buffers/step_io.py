"""Decoder step inputs and outputs: what one iteration's sampling reads and writes.

Inputs: which slots the outputs belong to, the rows of newly admitted requests whose decoder state
must be reset first, whether any row needs top-k/top-p/min-p, and how the beam requests' rows group by
width. Outputs: the sampled token and a finish code per request (``[R, 2]``, so that the outputs a step
used are one contiguous download; a beam request's K rows report once). Valid for
one iteration only, beside the persistent decoder state; a strategy may hold several sets at once
(overlap fills n+1's while the device still writes n's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.runtime.buffers.family import MAX_STOP_IDS, EngineSizes, StepFill
from strategies.runtime.buffers.mirrored import Memory, Mirrored
from strategies.runtime.request import Request

if TYPE_CHECKING:
    from strategies.runtime.models.config import ModelConfig

ADMIT_INTS = 7  # slot, tokens generated so far, max new tokens, seed, top_k, early_stopping, prompt_len; stop ids


def modes_in_use(slot_modes: np.ndarray, slots: np.ndarray) -> tuple[bool, bool]:
    """(some row uses top-k/top-p/min-p, some row samples at random) over the rows' ``slots [R]``, from
    ``slot_modes [S, 2]``: a slot's two flags read as one little-endian 16-bit word (filters the low byte) and
    OR-ed over the rows: a few array operations, where ``any(axis=0)`` costs more (docs/host-path.md)."""
    word = int(np.bitwise_or.reduce(slot_modes.view("<u2")[slots, 0]))  # [S, 2] bool viewed [S, 1]; 0 for no rows
    return bool(word & 0xFF), bool(word >> 8)


def shared_slot_modes(sizes: EngineSizes, shared: dict) -> np.ndarray:
    """[S, 2] per slot: its request uses filters, samples at random — one array for all of an engine's sets."""
    return shared.setdefault("slot_modes", np.zeros((sizes.num_slots, 2), dtype=bool))


class StepIO:
    name = "step"  # a buffer family (buffers/family.py)
    HOST_STATE = ("num_rows", "num_admit", "num_single", "groups", "use_filters", "any_random")  # as RuntimeBuffers'

    def __init__(self, max_batch: int, max_stop_ids: int, memory: Memory, slot_modes: np.ndarray) -> None:
        self.max_stop_ids = max_stop_ids
        # [S, 2] per slot: its request uses top-k/p/min-p filters, samples at random. Set at admission, read
        # per step by ``modes_in_use`` (not an any() over the requests' objects). Shared by an
        # engine's buffer sets: a slot's flags change only when a new request takes it, which no set still
        # being prepared can hold a row of.
        self.slot_modes = slot_modes
        self.slots = Mirrored(memory, (max_batch,), "int64")  # [R] slot of each request with an output
        self.admit = Mirrored(memory, (max_batch, ADMIT_INTS + max_stop_ids), "int64")  # [A, 7 + M]
        # [A, 4] temperature, top_p, min_p, length_penalty
        self.admit_f = Mirrored(memory, (max_batch, 4), "float32")
        # [R, 2] per request: its token (beam 0's for a beam request), finish code (device → host)
        self.out = Mirrored(memory, (max_batch, 2), "int64")
        self.rows: list[Request] = []  # the request of each output, in order (host only)
        # [R] the key of each output's slot when the step was prepared (host only; set at launch from the
        # strategy's progress book, whose ``hand_out`` gives a token there only to the tenure that asked for it)
        self.keys = np.zeros(max_batch, dtype=np.int64)
        self.num_rows = 0  # len(rows): what the device needs of them
        self.num_admit = 0
        self.num_single = 0  # leading outputs of one sampled row each; beam groups follow
        # One beam-search call per width: (width, requests, candidate pool, generated-length bound, KV bound)
        self.groups: list[tuple[int, int, int, int, int]] = []
        self.use_filters = False
        self.any_random = False

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: EngineSizes, memory: Memory, shared: dict) -> StepIO:
        return cls(sizes.max_batch, MAX_STOP_IDS, memory, shared_slot_modes(sizes, shared))

    def fill_step(self, f: StepFill) -> None:
        self.fill(f.order, f.batch.admitted, f.eos_token_id, f.batch.gen_slots)

    def fill(self, order: list[Request], admitted: list[Request], eos_token_id: int,
             gen_slots: np.ndarray | None = None) -> None:
        """``order``: the requests in output order (``ScheduledBatch.sampled_requests``); ``gen_slots [G]``:
        where the scheduler holds them as an array (``ScheduledBatch.gen_slots``, no beams), the slots of the
        generation requests that end ``order``."""
        self.rows = order
        self.num_rows = n = len(order)
        slots = self.slots.np
        k = n - (0 if gen_slots is None else len(gen_slots))
        slots[:k] = [r.slot for r in order[:k]]
        slots[k:n] = gen_slots if gen_slots is not None else ()
        self.num_admit = len(admitted)
        ints, floats, modes = self.admit.np, self.admit_f.np, self.slot_modes
        for i, r in enumerate(admitted):
            s = r.sampling
            modes[r.slot] = (s.uses_filters, s.temperature > 0)
            stops = self._stops(r, eos_token_id)
            row = ints[i]
            row[:ADMIT_INTS] = (r.slot, r.num_output_tokens, r.max_new_tokens, s.seed, s.top_k, s.early_stopping_code,
                                r.prompt_len)
            row[ADMIT_INTS:] = -1
            row[ADMIT_INTS:ADMIT_INTS + len(stops)] = stops
            floats[i] = (s.temperature, s.top_p, s.min_p, s.length_penalty)
        single = [r for r in order if r.width == 1] if len(order) and order[-1].width > 1 else order
        self.num_single = len(single)
        self.use_filters, self.any_random = modes_in_use(modes, slots[:self.num_single])
        self.groups = []
        for r in order[self.num_single:]:
            # HF keeps max(2, 1 + stop ids) x K candidates, so that K unfinished ones always remain.
            pool = max(2, 1 + len(self._stops(r, eos_token_id))) * r.width
            glen, kv_width = r.num_scheduled_samples, r.prompt_len + r.num_scheduled_samples
            if self.groups and self.groups[-1][0] == r.width:
                w, n, p, g, k = self.groups[-1]
                self.groups[-1] = (w, n + 1, max(p, pool), max(g, glen), max(k, kv_width))
            else:
                self.groups.append((r.width, 1, pool, glen, kv_width))

    @staticmethod
    def _stops(r: Request, eos_token_id: int) -> list[int]:
        s = r.sampling
        return list(s.stop_token_ids) + ([] if s.ignore_eos else [eos_token_id])

    def upload(self) -> None:
        self.slots.upload(self.num_rows)
        self.admit.upload(self.num_admit)
        self.admit_f.upload(self.num_admit)

    def download(self) -> None:
        self.out.download(self.num_rows)
