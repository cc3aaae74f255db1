"""Decoder state: the sampler's per-slot state on the device (not a model decoder).

One row per slot, persistent while a request holds the slot: the last sampled token (the next
generation step's input, so sampled tokens never have to visit the host before feeding the next step),
how many tokens the request has generated, its limits, stop ids, sampling parameters and seed, and its
finished flag and reason. Rows are (re)initialised on the device at admission, in stream order, so a
slot freed by the host and handed to a new request is never seen half-updated by an earlier step.
"""

from __future__ import annotations

import torch

from strategies.runtime.memory import DeviceMemory
from strategies.runtime.sampler import sample

# Finish codes the device writes; the host maps them to reasons. DISCARDED marks a row computed for a
# request the device already knew to be finished (overlap's one extra step; static's padding rows).
CONTINUE, STOP, LENGTH, DISCARDED = 0, 1, 2, -1
FINISH_REASONS = {STOP: "stop", LENGTH: "length"}


class DecoderState:
    def __init__(self, num_slots: int, max_stop_ids: int, memory: DeviceMemory) -> None:
        def ints(*shape: int, fill: int = 0) -> torch.Tensor:
            return memory.zeros(shape, torch.int64, fill)

        self.last_token = ints(num_slots)  # [S] next generation input
        self.gen_len = ints(num_slots)  # [S] tokens generated so far (the sampler's step counter)
        self.max_new = ints(num_slots)  # [S]
        self.stop_ids = ints(num_slots, max_stop_ids, fill=-1)  # [S, K] -1 = unused
        self.finished = memory.zeros((num_slots,), torch.bool)  # [S]
        self.seed = ints(num_slots)  # [S]
        self.top_k = ints(num_slots)  # [S]
        self.temperature = memory.zeros((num_slots,), torch.float32)  # [S]
        self.top_p = memory.zeros((num_slots,), torch.float32, 1.0)  # [S]
        self.min_p = memory.zeros((num_slots,), torch.float32)  # [S]
        self.max_stop_ids = max_stop_ids

    def admit(self, slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Reset rows for newly admitted requests. ints [A, 4+K]: gen_len, max_new, seed, top_k,
        stop ids; floats [A, 3]: temperature, top_p, min_p."""
        _admit(slots, ints, floats, self.gen_len, self.max_new, self.seed, self.top_k, self.stop_ids,
               self.temperature, self.top_p, self.min_p, self.finished)

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, use_filters: bool,
               any_random: bool) -> None:
        """Sample one token per row with each slot's parameters, record it, decide finishes; writes
        (token, finish code) rows into out [B, 2]. One TorchScript call."""
        _sample_and_apply(logits, slots, out, self.temperature, self.top_k, self.top_p, self.min_p, self.seed,
                          self.last_token, self.gen_len, self.max_new, self.stop_ids, self.finished, use_filters,
                          any_random)


@torch.jit.script
def _admit(slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, gen_len: torch.Tensor,
           max_new: torch.Tensor, seed: torch.Tensor, top_k: torch.Tensor, stop_ids: torch.Tensor,
           temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, finished: torch.Tensor) -> None:
    gen_len[slots] = ints[:, 0]
    max_new[slots] = ints[:, 1]
    seed[slots] = ints[:, 2]
    top_k[slots] = ints[:, 3]
    stop_ids[slots] = ints[:, 4:]
    temperature[slots] = floats[:, 0]
    top_p[slots] = floats[:, 1]
    min_p[slots] = floats[:, 2]
    finished[slots] = False


@torch.jit.script
def _apply(slots: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, last_token: torch.Tensor,
           gen_len: torch.Tensor, max_new: torch.Tensor, stop_ids: torch.Tensor, finished: torch.Tensor) -> None:
    active = ~finished[slots]  # [B] rows whose request the device still considers running
    new_len = gen_len[slots] + active.long()  # [B]
    hit_stop = (stop_ids[slots] == tokens.unsqueeze(1)).any(dim=1) & active  # [B]
    hit_len = (new_len >= max_new[slots]) & active & ~hit_stop  # [B]
    last_token[slots] = torch.where(active, tokens, last_token[slots])
    gen_len[slots] = new_len
    finished[slots] = finished[slots] | hit_stop | hit_len
    code = hit_stop.long() * 1 + hit_len.long() * 2  # STOP / LENGTH / CONTINUE
    out[:, 0] = tokens
    out[:, 1] = torch.where(active, code, torch.full_like(code, -1))


@torch.jit.script
def _sample_and_apply(logits: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, temperature: torch.Tensor,
                      top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor,
                      last_token: torch.Tensor, gen_len: torch.Tensor, max_new: torch.Tensor, stop_ids: torch.Tensor,
                      finished: torch.Tensor, use_filters: bool, any_random: bool) -> None:
    tokens = sample(logits, temperature[slots], top_k[slots], top_p[slots], min_p[slots], seed[slots], gen_len[slots],
                    use_filters, any_random)  # [B]
    _apply(slots, tokens, out, last_token, gen_len, max_new, stop_ids, finished)
