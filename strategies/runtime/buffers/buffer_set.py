"""A buffer set: everything one in-flight step owns, from prepare until its outputs are read.

A strategy holds as many as it has steps in flight: one for the synchronous loops, two for overlap (the
host fills n+1's while the device still runs n), one per micro-batch for the pipeline.
"""

from __future__ import annotations

from strategies.runtime.batch import BatchWork
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
        self.work: BatchWork | None = None  # the batch's size in cost-model units (records, simulated device)
