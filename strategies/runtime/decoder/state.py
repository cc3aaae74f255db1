"""Decoder state: the sampler's per-slot state on the device (not a model decoder).

One row per slot, persistent while a request holds the slot: the last sampled token (the next
generation step's input, so sampled tokens never have to visit the host before feeding the next step),
how many tokens the request has generated, its limits, stop ids, sampling parameters and seed, and its
finished flag and reason. Rows are (re)initialised on the device at admission, in stream order, so a
slot freed by the host and handed to a new request is never seen half-updated by an earlier step.

With beam search (``max_beam`` > 1) a slot owns ``max_beam`` beam rows: each beam's last token, running
score and generated tokens; the request's finished hypotheses (tokens, length, score); whether HF's
heuristic still allows an improvement; and one cache-indirection row per beam
(``[slots * max_beam, max_seq_len]``: the beam row whose KV each position reads, ``decoder/beam_search.py``).
"""

from __future__ import annotations

import torch

from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.decoder.accept import accept_drafts
from strategies.runtime.decoder.beam_search import beam_step
from strategies.runtime.decoder.sampler import sample


class DecoderState:
    def __init__(self, num_slots: int, max_stop_ids: int, memory: DeviceMemory, max_beam: int = 1,
                 max_seq_len: int = 0) -> None:
        def ints(*shape: int, fill: int = 0) -> torch.Tensor:
            return memory.zeros(shape, torch.int64, fill)

        self.max_beam = max_beam
        self.last_token = ints(num_slots, max_beam)  # [S, Kb] next generation input of each beam row
        self.last_token_rows = self.last_token.view(-1)  # [S * Kb] indexed by slot * Kb + beam
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
        # Beam buffers: empty unless some request may use beams, so greedy runs carry nothing extra.
        b, g = (max_beam, max_seq_len) if max_beam > 1 else (0, 0)
        self.length_penalty = memory.zeros((num_slots,), torch.float32, 1.0)  # [S]
        self.early_stopping = ints(num_slots)  # [S] 0 False, 1 True, 2 "never"
        self.prompt_len = ints(num_slots)  # [S]
        self.beam_score = memory.zeros((num_slots, b), torch.float32)  # [S, Kb] running log-probability
        self.beam_seq = ints(num_slots, b, g)  # [S, Kb, G] running beams' generated tokens
        self.hyp_seq = ints(num_slots, b, g)  # [S, Kb, G] finished hypotheses, best first
        self.hyp_len = ints(num_slots, b)  # [S, Kb]
        self.hyp_score = memory.zeros((num_slots, b), torch.float32)  # [S, Kb] length-penalised
        self.hyp_done = memory.zeros((num_slots, b), torch.bool)  # [S, Kb] a real hypothesis, not a placeholder
        self.improvable = memory.zeros((num_slots,), torch.bool)  # [S] HF's early-stop heuristic not yet met
        self.indirection = ints(num_slots * b, g)  # [S * Kb, L] beam row whose KV each position reads

    def admit(self, slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Reset rows for newly admitted requests. ints [A, 6+M]: gen_len, max_new, seed, top_k,
        early_stopping, prompt_len, stop ids; floats [A, 4]: temperature, top_p, min_p, length_penalty."""
        _admit(slots, ints, floats, self.gen_len, self.max_new, self.seed, self.top_k, self.stop_ids,
               self.temperature, self.top_p, self.min_p, self.finished, self.early_stopping, self.prompt_len,
               self.length_penalty)
        if self.max_beam > 1:
            _admit_beams(slots, self.max_beam, self.beam_score, self.hyp_score, self.hyp_len, self.hyp_done,
                         self.improvable, self.indirection)

    def beam_step(self, logits: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, width: int, pool: int,
                  glen: int, kv_width: int) -> None:
        """One beam-search step for requests of one beam width (``beam_search.beam_step``)."""
        beam_step(logits, slots, out, width, pool, glen, kv_width, self.max_beam, self.beam_score, self.beam_seq,
                  self.hyp_seq, self.hyp_score, self.hyp_len, self.hyp_done, self.improvable, self.indirection,
                  self.gen_len, self.max_new, self.stop_ids, self.finished, self.length_penalty, self.early_stopping,
                  self.prompt_len, self.last_token)

    def accept(self, logits: torch.Tensor, slots: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
               out: torch.Tensor, use_filters: bool, any_random: bool) -> None:
        """Speculative decoding: verify each row's drafts, keep what the target agrees with, decide
        finishes (``decoder/accept.py``). One TorchScript call."""
        accept_drafts(logits, slots, drafts, num_drafts, out, self.temperature, self.top_k, self.top_p, self.min_p,
                      self.seed, self.last_token, self.gen_len, self.max_new, self.stop_ids, self.finished, use_filters,
                      any_random)

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
           temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, finished: torch.Tensor,
           early_stopping: torch.Tensor, prompt_len: torch.Tensor, length_penalty: torch.Tensor) -> None:
    gen_len[slots] = ints[:, 0]
    max_new[slots] = ints[:, 1]
    seed[slots] = ints[:, 2]
    top_k[slots] = ints[:, 3]
    early_stopping[slots] = ints[:, 4]
    prompt_len[slots] = ints[:, 5]
    stop_ids[slots] = ints[:, 6:]
    temperature[slots] = floats[:, 0]
    top_p[slots] = floats[:, 1]
    min_p[slots] = floats[:, 2]
    length_penalty[slots] = floats[:, 3]
    # index_fill_ with a scalar: ``x[slots] = False`` would make the scalar a device tensor first (a copy
    # from the host on CUDA; tests/test_host_syncs.py)
    finished.index_fill_(0, slots, False)


@torch.jit.script
def _admit_beams(slots: torch.Tensor, max_beam: int, beam_score: torch.Tensor, hyp_score: torch.Tensor,
                 hyp_len: torch.Tensor, hyp_done: torch.Tensor, improvable: torch.Tensor,
                 indirection: torch.Tensor) -> None:
    # HF starts beam 0 at 0 and the others at -1e9, so that the first step's K candidates all extend the
    # prompt once instead of K identical beams; hypotheses start as -1e9 placeholders.
    neg = -1.0e9  # beam_search.NEG (TorchScript reads no module globals)
    init = torch.full((max_beam,), neg, dtype=beam_score.dtype, device=beam_score.device)  # [Kb]
    init.narrow(0, 0, 1).fill_(0.0)
    beam_score[slots] = init
    hyp_score.index_fill_(0, slots, neg)  # scalars filled in place, never made tensors (as in _admit)
    hyp_len.index_fill_(0, slots, 0)
    hyp_done.index_fill_(0, slots, False)
    improvable.index_fill_(0, slots, True)
    # Every position reads beam row 0 (the prompt's) until a step gives a beam positions of its own; a
    # single-beam request in the same slot reads through these rows too, so they are reset for everyone.
    rows = (slots * max_beam).unsqueeze(1) + torch.arange(max_beam, device=slots.device).unsqueeze(0)  # [A, Kb]
    indirection.index_fill_(0, rows.flatten(), 0)


@torch.jit.script
def _apply(slots: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, last_token: torch.Tensor,
           gen_len: torch.Tensor, max_new: torch.Tensor, stop_ids: torch.Tensor, finished: torch.Tensor) -> None:
    active = ~finished[slots]  # [B] rows whose request the device still considers running
    new_len = gen_len[slots] + active.long()  # [B]
    hit_stop = (stop_ids[slots] == tokens.unsqueeze(1)).any(dim=1) & active  # [B]
    hit_len = (new_len >= max_new[slots]) & active & ~hit_stop  # [B]
    last_token[slots, 0] = torch.where(active, tokens, last_token[slots, 0])
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
