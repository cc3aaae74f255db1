"""A buffer set: everything one in-flight step owns, from prepare until its outputs are read — one instance of
every registered buffer family (``family.py``).

A strategy holds as many as it has steps in flight: one for the synchronous loops, two for overlap (the
host fills n+1's while the device still runs n), one per micro-batch for the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.runtime.batch import BatchWork
from strategies.runtime.buffers.draft_tokens import DraftTokens
from strategies.runtime.buffers.encoder_buffers import EncoderBuffers
from strategies.runtime.buffers.family import BufferFamily, EngineSizes, StepFill
from strategies.runtime.buffers.kv_copies import KVCopies
from strategies.runtime.buffers.runtime_buffers import RuntimeBuffers
from strategies.runtime.buffers.step_io import StepIO

if TYPE_CHECKING:
    from strategies.runtime.buffers.mirrored import Memory
    from strategies.runtime.models.config import ModelConfig

# The registration: every family an engine may keep, in the order a step fills, uploads and downloads them
# (the draft tokens read the step I/O's slot modes, which its fill sets).
FAMILIES: tuple[type[BufferFamily], ...] = (RuntimeBuffers, StepIO, DraftTokens, EncoderBuffers, KVCopies)


class BufferSet:
    """One in-flight step's buffers: an instance of each family the engine keeps, as ``bufs.<family name>``."""

    runtime: RuntimeBuffers  # engine inputs and outputs (always)
    step: StepIO  # decoder step inputs and outputs (always)
    drafts: DraftTokens | None  # speculative decoding: verifying rows' drafts and accept outputs
    encoder: EncoderBuffers | None  # encoder–decoder models: encoder and cross-attention inputs
    kv_copies: KVCopies | None  # the host KV tier: blocks the step offloads and onloads

    def __init__(self, index: int, families: dict[str, BufferFamily | None]) -> None:
        self.index = index
        for name, family in families.items():
            setattr(self, name, family)
        self.families = [f for f in families.values() if f is not None]  # the ones this engine keeps
        self._all = list(families.values())  # with None where absent: the host state's fixed layout
        self.work: BatchWork | None = None  # the batch's size in cost-model units (records, simulated device)

    def fill_step(self, fill: StepFill) -> None:
        """Host side: every family writes the step into its staging half."""
        for f in self.families:
            f.fill_step(fill)
        self.work = fill.batch.work()

    def upload(self) -> None:
        """On the device stream, in the step's forward."""
        for f in self.families:
            f.upload()

    def download(self) -> None:
        """On the device stream, once the step's outputs are written."""
        for f in self.families:
            f.download()

    def host_state(self) -> tuple:
        """The host ints and lists the device pieces of this set's step read (beside its tensors)."""
        return tuple(tuple(getattr(f, name) for name in f.HOST_STATE) if f is not None else None for f in self._all)

    def set_host_state(self, state: tuple) -> None:
        """The twin of ``host_state``: a device in another process applies what the host prepared."""
        for f, values in zip(self._all, state, strict=True):
            if f is not None:
                for name, value in zip(f.HOST_STATE, values, strict=True):
                    setattr(f, name, value)


def build_buffer_sets(cfg: ModelConfig, sizes: EngineSizes, memory: Memory,
                      families: tuple[type[BufferFamily], ...] = FAMILIES) -> list[BufferSet]:
    """``sizes.num_buffer_sets`` sets of every family in ``families`` (each family's ``build`` may decline)."""
    shared: dict = {}  # arrays the sets hold in common (the per-slot sampling modes)
    return [BufferSet(i, {f.name: f.build(cfg, sizes, memory, shared) for f in families})
            for i in range(sizes.num_buffer_sets)]
