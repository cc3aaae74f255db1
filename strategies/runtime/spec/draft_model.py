"""A draft model: a second engine that proposes K tokens autoregressively for the verifying rows (Hugging
Face's ``assistant_model``, vLLM's draft-model proposer, TensorRT-LLM's two-model speculative decoding).

Its engine is the runtime's (weights, KV pool, decoder state, buffers) on a device stream of its own. Its KV
pool has as many blocks as the target's and is indexed by the target's block tables: the draft keeps its
keys at the positions the target keeps its own, in a pool of its own, so the target's reservation covers
both and releasing a request frees both. Before a target step with verifying rows it runs k passes: pass 1
feeds each row the tokens the draft has not seen yet (at first its whole prompt; then the token the target
added, and the drafts it accepted the draft had no keys for) as a chunk, and samples d1; pass j feeds
d(j-1), read on the device from the draft's decoder state as any generation input is, and samples dj.
Drafts are greedy: a deterministic proposal, which is what the accept step's rejection sampling assumes
(``decoder/accept.py``). The k passes are launched one after another, each into a buffer set of its own, and
the host waits once, for the last (TensorRT-LLM keeps that loop on the device too). Under overlap a row
whose last token is still on the device drafts past the draft's own guess of it (``propose``).

Rollback: after verification the draft's keys are valid up to the last position whose input was right,
``Request.draft_computed`` = p + 1 + min(accepted, k - 1); the next pass 1 starts there. A preempted
request starts over (0), as the target does.
"""

from __future__ import annotations

import numpy as np
import torch

from strategies.runtime.batch import ContextChunk, ScheduledBatch, VerifyStep
from strategies.runtime.device.stream import DeviceStream
from strategies.runtime.engine import Engine
from strategies.runtime.models.checkpoint import load_checkpoint, resolve_model_config
from strategies.runtime.models.config import PRESETS, ModelConfig
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(ignore_eos=True)  # drafts: argmax, never a finish


class _DraftRow:
    """The draft engine's view of a request: its slot and tokens, greedy sampling that never stops."""

    sampling = GREEDY
    width = 1  # one row, no beams
    encoder_len = 0
    num_output_tokens = 0  # the draft's sampler counter starts at 0 (greedy: unused)
    max_new_tokens = 2**40  # never a length finish
    num_scheduled_samples = 0

    def __init__(self, request: Request) -> None:
        self.request = request
        self.slot = request.slot
        self.prompt_len = request.prompt_len

    @property
    def token_ids(self) -> np.ndarray:
        return self.request.token_ids


def draft_config(name_or_path: str, target: ModelConfig) -> ModelConfig:
    """The draft's config, in the target's dtype: a preset or a checkpoint directory of a decoder-only model
    that shares the target's vocabulary (its tokens are the target's)."""
    cfg = resolve_model_config(name_or_path).with_dtype(target.dtype)
    if cfg.vocab_size != target.vocab_size or cfg.is_encoder_decoder:
        raise ValueError(f"--speculative-config model {name_or_path!r}: a decoder-only model with the target's "
                         f"vocabulary ({target.vocab_size} tokens) is needed, not {cfg.vocab_size}")
    return cfg


def load_draft_model(name_or_path: str, target: ModelConfig, compile: bool) -> tuple[ModelConfig, torch.nn.Module]:
    """The draft (``draft_config``): a preset's seeded random weights or the checkpoint's."""
    cfg = draft_config(name_or_path, target)
    model = build_model(cfg) if name_or_path in PRESETS else load_checkpoint(name_or_path, cfg)
    return cfg, (script_model(model) if compile else model)


class DraftModel:
    def __init__(self, engine: Engine, stream: DeviceStream) -> None:
        self.engine = engine
        self.stream = stream

    def propose(self, steps: list[VerifyStep], tables: np.ndarray) -> None:
        """Fill each step's drafts in place (``VerifyStep.drafts``, k of them) with the draft's greedy tokens.
        ``tables [S, 1, MB]``: the target's block tables.

        A row whose last token is still on the device (overlap: pending, position p = what the host holds)
        takes one pass more: pass 1 feeds what the host holds and samples a guess of the pending token, which
        pass 2 feeds at p; the k passes after the guess are its drafts. The target's chunk starts with the
        real token (read on the device), so a wrong guess costs acceptance, never a token; the draft's key at
        p came from the guess, so its keys count only up to p afterwards."""
        rows = [_DraftRow(v.request) for v in steps]
        guessed = [int(len(v.request.token_ids) == v.position) for v in steps]  # the pending rows: 1 pass more
        batch = ScheduledBatch(-1)
        for v, row, g in zip(steps, rows, guessed, strict=True):
            start = min(v.request.draft_computed, v.position - g)  # pass 1 feeds >= 1 token, to sample from
            batch.context.append(ContextChunk(row, start, v.position + 1 - g - start, True))  # type: ignore[arg-type]
            if start == 0:  # a new tenure of the slot: the draft's decoder-state row is reset
                batch.admitted.append(row)  # type: ignore[arg-type]
        passes = max(len(v.drafts) + g for v, g in zip(steps, guessed, strict=True))
        assert passes <= len(self.engine.buffer_sets), "a buffer set per pass"
        for j in range(passes):  # every pass launched before any is waited for: a pass's input token is read
            if j:  # on the device (the previous pass's sample), so the host needs none of their outputs first
                batch = ScheduledBatch(-1)  # pass j + 1: one token for each row that wants another
                for v, row, g in zip(steps, rows, guessed, strict=True):
                    if len(v.drafts) + g > j:
                        batch.add_generation(row, v.position + j - g)  # type: ignore[arg-type]
            batch.no_beams()
            self.engine.prepare(batch, self.engine.buffer_sets[j], tables)
            work = self.engine.launch(-1, self.engine.buffer_sets[j])
        self.stream.wait(work)  # the last pass; stream order ran the others before it
        for j in range(passes):
            tokens = iter(self.engine.outputs(self.engine.buffer_sets[j])[:, 0].tolist())
            for v, g in zip(steps, guessed, strict=True):
                if len(v.drafts) + g > j:
                    token = next(tokens)
                    if j >= g:  # a guessed row's first token is the guess, not a draft
                        v.drafts[j - g] = token
        for v, g in zip(steps, guessed, strict=True):  # keys through the last draft fed in (postprocess
            # rewinds to what was accepted); a guessed row's only up to its pending position
            v.request.draft_computed = v.position if g else v.position + len(v.drafts)

    def close(self) -> None:
        self.stream.close()
        self.engine = None  # type: ignore[assignment]
