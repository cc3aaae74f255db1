"""The default --max-seq-len: the model's context length, capped by what the KV pool holds."""

from __future__ import annotations

import dataclasses

from harness.errors import UserError
from harness.options import RunOptions
from strategies.runtime.models.config import ModelConfig


def resolve_max_seq_len(opts: RunOptions, model_cfg: ModelConfig) -> RunOptions:
    """``opts`` with --max-seq-len given: by default the model's context length (its config's
    max_position_embeddings, or the simulated spec's), capped by what the KV pool can hold."""
    if opts.max_seq_len is not None:
        return opts
    value = model_cfg.max_position_embeddings
    pool = opts.kv_blocks * opts.tokens_per_block if opts.kv_blocks else None
    if pool is None and opts.device == "sim":  # what the GPU's memory leaves for KV after the weights
        from strategies.runtime.sim.build import cost_model

        try:
            cost = cost_model(opts.sim_config())
        except ValueError as exc:
            raise UserError(str(exc)) from None
        pool = cost.kv_capacity_tokens() // (2 if cost.spec.is_encoder_decoder else 1)
    if pool is not None:
        value = min(value, max(pool, opts.tokens_per_block))
    return dataclasses.replace(opts, max_seq_len=value)
