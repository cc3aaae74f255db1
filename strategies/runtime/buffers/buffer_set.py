"""A buffer set: everything one in-flight step owns, from prepare until its outputs are read.

A strategy holds as many as it has steps in flight: one for the synchronous loops, two for overlap (the
host fills n+1's while the device still runs n), one per micro-batch for the pipeline.
"""

from __future__ import annotations

from strategies.runtime.batch import BatchWork
from strategies.runtime.buffers.draft_tokens import DraftTokens
from strategies.runtime.buffers.encoder_buffers import EncoderBuffers
from strategies.runtime.buffers.runtime_buffers import RuntimeBuffers
from strategies.runtime.buffers.step_io import StepIO


class BufferSet:
    """One in-flight step's buffers: engine inputs/outputs plus decoder step inputs/outputs."""

    def __init__(self, index: int, runtime: RuntimeBuffers, step: StepIO) -> None:
        self.index = index
        self.runtime = runtime
        self.step = step
        self.encoder: EncoderBuffers | None = None  # encoder–decoder models: encoder and cross-attention inputs
        self.drafts: DraftTokens | None = None  # speculative decoding: verifying rows' drafts and accept outputs
        self.work: BatchWork | None = None  # the batch's size in cost-model units (records, simulated device)

    def host_state(self) -> tuple:
        """The host ints and lists the device pieces of this set's step read (beside its tensors)."""
        parts = (self.runtime, self.step, self.encoder, self.drafts)
        return tuple(tuple(getattr(p, name) for name in p.HOST_STATE) if p is not None else None for p in parts)

    def set_host_state(self, state: tuple) -> None:
        """The twin of ``host_state``: a device in another process applies what the host prepared."""
        for p, values in zip((self.runtime, self.step, self.encoder, self.drafts), state, strict=True):
            if p is not None:
                for name, value in zip(p.HOST_STATE, values, strict=True):
                    setattr(p, name, value)
