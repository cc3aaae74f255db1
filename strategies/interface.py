"""What the harness drives: an executor serving a request source, and the source it serves.

Every engine the harness runs — slotbench's strategies (``strategies/base.py``) and the peers
(``strategies/peers/``) — is an ``Executor``: it takes requests from a ``RequestSource``, ends each one
(finished, rejected or failed), keeps one ``IterationRecord`` per step, and closes. ``rejection`` is the
one place that says which requests an executor can never serve.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from strategies.config import ExecutorConfig
from strategies.runtime.buffers.family import MAX_STOP_IDS
from strategies.runtime.buffers.slots import SlotTenure
from strategies.runtime.device.clock import Clock
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.kv.block_manager import beam_blocks
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request, Status

if TYPE_CHECKING:
    import torch


class RequestSource(Protocol):
    """Where requests come from (the harness's trace replay): arrivals, and who to tell of an end."""

    def poll(self, now_s: float) -> list[Request]:
        """Requests that have arrived by ``now_s`` and may be sent, each once."""

    def next_arrival_s(self) -> float | None:
        """When the next request can arrive; None if none will until a request ends (or ever)."""

    @property
    def exhausted(self) -> bool:
        """True once every request has been handed out."""

    def on_finished(self, request: Request) -> None:
        """A request reached a terminal status (finished or rejected)."""


class ExecutorStalled(RuntimeError):
    pass


class Executor(ABC):
    """What the harness drives: serve a request source, keep iteration records, close."""

    name: ClassVar[str]
    speculates: ClassVar[bool] = False  # runs speculative decoding (--speculative-config)

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 clock: Clock | None = None) -> None:
        self.model_cfg = model_cfg
        self.model = model
        self.config = config
        self.clock = clock or make_clock(config)
        self.records: list[IterationRecord] = []
        self.source: RequestSource | None = None
        self.iteration_hook: Callable[[int], None] | None = None  # called as each iteration starts

    @abstractmethod
    def run(self, source: RequestSource) -> None:
        """Serve every request ``source`` hands out until none is left. Raises on an engine fault; the
        requests then keep the state they reached, for the caller to mark failed."""

    def close(self) -> None:
        """Release threads and devices; safe to call after a failure."""

    def slot_tenures(self) -> list[SlotTenure]:
        """Who held which request slot from which step to which (an engine without slots: none)."""
        return []

    def extras(self) -> dict:
        """What this executor records beyond requests, steps and slots (the run's files name each)."""
        return {}

    def take_history(self) -> tuple[list[IterationRecord], list[SlotTenure]]:
        """The records of steps that are done and the slot tenures that have ended, handed over and forgotten: a
        long-running server writes them away as it goes (the engine's thread, between steps). An executor that
        cannot hands over nothing and keeps all."""
        return [], []

    def abort(self, r: Request, reason: str) -> None:
        """End ``r`` now, failed with ``reason`` (a server's client went away); the engine's thread only."""
        raise NotImplementedError(f"{self.name} cannot abort a request")

    def inject_fault(self, iteration: int) -> None:
        """Test hook: make the device step raise at ``iteration``."""
        raise NotImplementedError(f"{self.name} has no fault hook")

    def rejection(self, r: Request) -> str | None:
        """Why ``r`` can never be served by this executor, or None."""
        c, cfg = self.config, self.model_cfg
        if r.prompt_len == 0:
            return "empty prompt"
        if r.max_new_tokens <= 0:
            return f"max_new_tokens must be positive, got {r.max_new_tokens}"
        if r.prompt_len + r.max_new_tokens > c.max_seq_len:
            return (f"prompt ({r.prompt_len}) + max_new_tokens ({r.max_new_tokens}) exceeds "
                    f"max_seq_len ({c.max_seq_len})")
        if r.width > c.max_beam_width:
            return f"beam width {r.width} exceeds the executor's maximum ({c.max_beam_width})"
        if beam_blocks(r.prompt_len + r.max_new_tokens, c.tokens_per_block, r.width, r.prompt_len) > c.total_kv_blocks:
            return f"needs more KV blocks than the cache has ({c.total_kv_blocks})"
        if len(r.sampling.stop_token_ids) >= MAX_STOP_IDS:
            return f"at most {MAX_STOP_IDS - 1} stop token ids"
        if r.prompt_token_ids.view(np.uint64).max() >= cfg.vocab_size:  # (one pass: a negative id is >= 2^63 there)
            return f"prompt token id outside the vocabulary [0, {cfg.vocab_size})"
        return self._encoder_rejection(r)

    def _encoder_rejection(self, r: Request) -> str | None:
        c, cfg = self.config, self.model_cfg
        if not cfg.is_encoder_decoder:
            return "encoder input given to a decoder-only model" if r.encoder_len else None
        if r.encoder_len == 0:
            return "an encoder–decoder model needs encoder input"
        if r.width > 1:
            return "beam search with an encoder–decoder model is not supported"
        if r.encoder_len > c.max_seq_len or r.encoder_len >= c.max_num_tokens:
            return (f"encoder input ({r.encoder_len}) must fit max_seq_len ({c.max_seq_len}) and leave room in "
                    f"max_num_tokens ({c.max_num_tokens}): it is encoded whole, in the step that admits it")
        if -(-r.encoder_len // c.tokens_per_block) > c.total_cross_kv_blocks:
            return f"needs more cross-attention KV blocks than the cache has ({c.total_cross_kv_blocks})"
        ids = r.encoder_prompt_token_ids
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            return f"encoder token id outside the vocabulary [0, {cfg.vocab_size})"
        return None

    def _reject(self, r: Request, reason: str) -> None:
        r.end(Status.REJECTED, reason)
        assert self.source is not None
        self.source.on_finished(r)


def make_clock(config: ExecutorConfig) -> Clock:
    """The run clock: wall time, or the simulated device's virtual time."""
    if config.device == "sim":
        from strategies.runtime.sim.build import virtual_clock

        assert config.sim is not None
        return virtual_clock(config.sim)
    return Clock()
