"""A buffer family: one kind of per-step buffer an engine keeps in every buffer set (runtime buffers, decoder
step I/O, draft tokens, encoder buffers), declared once so that every engine handles it the same way.

A family says, in its own module:

- ``name``: its attribute on a ``BufferSet`` (``bufs.drafts``);
- ``build(cfg, sizes, memory, shared)``: one instance per buffer set, or None where the engine needs none
  (``shared``: arrays every set of the engine holds in common, such as the decoder's per-slot sampling modes);
- ``fill_step(fill)``: the host writes the step into its staging half (``StepFill``: the batch and tables);
- ``upload()`` and ``download()``: issued on the device stream, in the step's forward and after its sample;
- ``HOST_STATE``: the host ints and lists its device side reads (sent with the step to a device process).

It is registered once, in ``buffer_set.FAMILIES``. The engines — real, simulated, encoder–decoder, pipeline —
build, fill, upload and download every registered family through ``BufferSet``; what the device *computes*
with a family's tensors (the sampler's accept step with the drafts, the encoder with its inputs) stays in the
engine piece that computes it. docs/buffers.md walks through adding one, with the draft tokens as the example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from strategies.runtime.batch import ScheduledBatch
    from strategies.runtime.buffers.mirrored import Memory
    from strategies.runtime.models.config import ModelConfig
    from strategies.runtime.request import Request

MAX_STOP_IDS = 8  # EOS plus up to seven per-request stop ids (the decoder step I/O's and decoder state's width)


@dataclass(frozen=True)
class EngineSizes:
    """The sizes an engine's buffers are allocated at, once (never per step)."""

    num_slots: int  # request slots: rows of the decoder state
    max_seq_len: int  # longest sequence (prompt + output) a slot holds
    max_tokens: int  # tokens one forward takes (the step's budget)
    max_batch: int  # requests one step holds
    num_buffer_sets: int  # steps in flight at once (overlap: 2; pipeline: its micro-batches)
    num_blocks: int  # KV blocks of the pool
    tokens_per_block: int
    max_beam: int = 1  # widest beam search
    max_drafts: int = 0  # speculative decoding's K (0: no draft-token buffers)
    kv_staging_blocks: int = 0  # disaggregated serving: the KV staging buffer's blocks (0: none)
    kv_offload_blocks: int = 0  # the host KV tier's blocks (0: no tier)


@dataclass
class StepFill:
    """What a family's ``fill_step`` may read of one step, made once by the engine's ``prepare``."""

    batch: ScheduledBatch
    order: list[Request]  # the requests with an output this step, in row order (batch.sampled_requests)
    block_table: np.ndarray  # [S, Kb, MB] the block manager's table, per slot and beam
    cross_table: np.ndarray | None  # [S, MB] encoder–decoder models' cross-attention blocks, else None
    eos_token_id: int


class BufferFamily(Protocol):
    name: ClassVar[str]
    HOST_STATE: ClassVar[tuple[str, ...]]

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: EngineSizes, memory: Memory, shared: dict[str, Any]) -> BufferFamily | None:
        ...

    def fill_step(self, fill: StepFill) -> None: ...

    def upload(self) -> None: ...

    def download(self) -> None: ...
