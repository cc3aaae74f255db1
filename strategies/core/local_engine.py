"""An engine's buffer sizes, and a device this process drives (CPU, CUDA, or the CPU stand-in for CUDA's split
memory) with its engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.config import ExecutorConfig
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.factory import make_stream
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.engine import Engine
from strategies.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    import torch


def engine_sizes(c: ExecutorConfig, max_tokens: int, depth: int) -> dict[str, int]:
    """The engine's buffer sizes: its slots, a step's tokens and rows, a buffer set per step in flight, the KV
    pool and its host tier, beams and drafts."""
    return {"num_slots": c.max_batch_size, "max_seq_len": c.max_seq_len, "max_tokens": max_tokens,
            "max_batch": c.max_batch_size, "num_buffer_sets": depth, "num_blocks": c.total_kv_blocks,
            "tokens_per_block": c.tokens_per_block, "max_beam": c.max_beam_width,
            "max_drafts": c.speculative.num_speculative_tokens if c.speculative else 0,
            "kv_offload_blocks": c.kv_offload_blocks}


def local_engine(c: ExecutorConfig, clock: Clock, nvtx: Nvtx, sizes: dict, cfg: ModelConfig,
                 model: torch.nn.Module) -> tuple:
    """(stream, engine) for ``cfg``'s model: a strategy's own, or its draft model's."""
    stream = make_stream(c.device, clock, nvtx, c.device_threads, c.memory, c.cpu_device)
    try:
        if cfg.is_encoder_decoder:
            from strategies.runtime.encdec_engine import EncoderDecoderEngine

            return stream, stream.build_engine(EncoderDecoderEngine, cfg, model,
                                               cross_blocks=c.total_cross_kv_blocks, **sizes)
        return stream, stream.build_engine(Engine, cfg, model, **sizes)
    except BaseException:  # a refused size: no worker thread or CPU budget is left behind
        stream.close()
        raise
