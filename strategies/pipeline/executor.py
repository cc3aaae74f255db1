"""Pipeline parallelism: the in-flight policy, with M micro-batches in flight over N stage processes.

The model's layers are split into N contiguous stages, each a process of its own with only its layers'
KV cache (``strategies/runtime/pipeline/``). While stage 1 computes micro-batch k, stage 0 can compute
k+1: up to M micro-batches are in flight, each with its own buffer set on the host and on every stage.
Unlike overlap, which keeps the *same* requests in consecutive steps (their next input is read on the
device), a micro-batch holds requests no other in-flight micro-batch holds (TensorRT-LLM's
``inflight_req_ids``): a request's next token is unknown until its micro-batch leaves the last stage.
The host schedules from the requests that are not in flight, with the in-flight scheduler and its
capacity policies, each micro-batch taking at most its share (``max_batch_size / M``) of the slots; the
decoder state (sampling, finishes) stays single, on the last stage.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from strategies.base import Strategy
from strategies.config import ExecutorConfig
from strategies.core.engine_core import Step
from strategies.running import RunningRequests
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.device.clock import Clock
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request
from strategies.scheduler import IterationScheduler

if TYPE_CHECKING:
    import torch


class PipelineStrategy(Strategy):
    name = "pipeline"
    speculates = False  # its stages would each need the drafts; not built

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 clock: Clock | None = None) -> None:
        self.depth = config.micro_batches  # the engine core's queue: a micro-batch a step, each in its buffer set
        self.separate_processes = config.device != "sim"  # simulated: one process, stages timed by the stream
        self.pipeline_stages = config.pipeline_stages
        self._in_flight: set[int] = set()  # id() of every request in a launched micro-batch
        self._members: dict[int, list[Request]] = {}  # iteration in flight → its requests
        super().__init__(model_cfg, model, config, clock)
        # The slots are shared by the M micro-batches: each takes at most its share of rows, so that the
        # pipeline fills with M micro-batches of similar size instead of one that takes every request.
        self.rows_per_micro_batch = -(-config.max_batch_size // self.depth)
        micro_batch = replace(config, max_batch_size=self.rows_per_micro_batch)
        self.scheduler.policy = IterationScheduler(micro_batch, self.kv, self.progress, self.cross_kv)

    def _process_engine(self, sizes: dict) -> tuple:
        from strategies.runtime.pipeline.stage_group import PipelineEngine

        c = self.config
        if self.model_cfg.is_encoder_decoder:
            raise ValueError("pipeline: the stage processes run decoder-only (Llama-style) models")
        if c.device != "cpu":
            raise ValueError(f"pipeline: stage processes run on the CPU (gloo) here, not {c.device}")
        engine = PipelineEngine(self.model_cfg, self.model, self.clock, self.nvtx, stages=c.pipeline_stages,
                                timeout_s=c.stage_timeout_s, threads=c.device_threads, **sizes)
        return engine.stream, engine

    def inject_stage_fault(self, stage: int, iteration: int, kind: int) -> None:
        """Test hook: stage ``stage`` dies (DIE) or stops answering (HANG) at ``iteration``."""
        self.engine.stage_fault = (stage, iteration, kind)

    def inject_fault(self, iteration: int) -> None:
        """The harness's fault hook: the last stage process dies at ``iteration``."""
        from strategies.runtime.pipeline.messages import DIE

        self.inject_stage_fault(self.config.pipeline_stages - 1, iteration, DIE)

    def rejection(self, r: Request) -> str | None:
        if r.width > 1:
            return "pipeline: beam search is not supported"
        return super().rejection(r)

    def schedulable(self) -> RunningRequests:
        """The running requests no micro-batch in flight holds, at most a micro-batch's share of them."""
        return self.running.select([id(r) not in self._in_flight for r in self.running], self.rows_per_micro_batch)

    def launching(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> None:
        """The micro-batch's requests are in flight until it comes back: no other micro-batch takes them."""
        rec.micro_batch = bufs.index
        members = [c.request for c in batch.context] + batch.gen_requests
        self._in_flight.update(id(r) for r in members)
        self._members[rec.iteration] = members

    def retired(self, step: Step) -> None:
        self._in_flight.difference_update(id(r) for r in self._members.pop(step.record.iteration))
