"""Micro-benchmarks (pytest-benchmark). Skipped in the default run; run with
``python -m pytest tests/benchmarks --benchmark-only``; see the README for saving and comparing."""

from collections import deque

import numpy as np
import pytest
import torch

from strategies.base import get_strategy
from strategies.config import ExecutorConfig
from strategies.runtime.batch import GenerationStep, ScheduledBatch
from strategies.runtime.clock import Clock
from strategies.runtime.device import CpuWorkerStream
from strategies.runtime.kv_cache import KVCacheManager
from strategies.runtime.model import PRESETS, build_model
from strategies.runtime.request import Request, SamplingParams
from strategies.runtime.runtime_buffers import RuntimeBuffers
from strategies.runtime.sampler import sample
from strategies.runtime.step_io import StepIO
from strategies.runtime.tracing import Nvtx
from strategies.scheduler import IterationScheduler

torch.set_num_threads(1)


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("vocab", [32000, 128256])
@pytest.mark.parametrize("mode", ["greedy", "top-p"])
def test_sampler(benchmark, batch, vocab, mode):
    logits = torch.randn(batch, vocab)
    temp = torch.full((batch,), 0.0 if mode == "greedy" else 0.8)
    top_k, top_p, min_p = torch.zeros(batch, dtype=torch.long), torch.full((batch,), 0.9), torch.zeros(batch)
    seeds, steps = torch.arange(batch), torch.zeros(batch, dtype=torch.long)
    filters, random = mode == "top-p", mode == "top-p"
    benchmark(sample, logits, temp, top_k, top_p, min_p, seeds, steps, filters, random)


def _requests(n: int, prompt: int = 128) -> list[Request]:
    return [Request(f"r{i}", np.arange(prompt) % 500, 64, SamplingParams()) for i in range(n)]


@pytest.mark.parametrize("rows", [8, 64, 256])
def test_buffer_preparation(benchmark, rows):
    """Host-side fill of runtime buffers + step I/O for one generation step of ``rows`` requests."""
    stream = CpuWorkerStream(Clock(), Nvtx(False))
    try:
        rb = RuntimeBuffers(4096, rows, 512, 32000, stream, torch.float32)
        io = StepIO(rows, 8, stream)
        reqs = _requests(rows)
        for i, r in enumerate(reqs):
            r.admit(i, i)
            r.num_computed_tokens = r.prompt_len
        batch = ScheduledBatch(0, generation=[GenerationStep(r, r.prompt_len) for r in reqs])

        def prepare():
            rb.fill(batch)
            io.fill(batch, 2)

        benchmark(prepare)
    finally:
        stream.close()


@pytest.mark.parametrize("waiting", [1, 32, 512])
def test_scheduler_step(benchmark, waiting):
    """One in-flight schedule over a full queue: admissions into 64 slots within the token budget."""
    cfg = ExecutorConfig(max_batch_size=64, max_num_tokens=4096, max_seq_len=512)

    def setup():
        kv = KVCacheManager(cfg.tokens_per_block, cfg.total_kv_blocks)
        queue = deque(_requests(waiting, prompt=48))
        free = list(range(64))
        return (IterationScheduler(cfg, kv), queue, [], free), {}

    def step(sched, queue, running, free):
        def admit(r, reserve):
            r.admit(free.pop(), 0)
            sched.kv.grow(r.request_id, reserve)
            running.append(r)
        sched.schedule(0, queue, running, len(free), admit, lambda r: None)

    benchmark.pedantic(step, setup=setup, rounds=50)


def test_kv_accounting(benchmark):
    kv = KVCacheManager(16, 100_000)
    owners = [f"r{i}" for i in range(256)]

    def churn():
        for i, o in enumerate(owners):
            kv.grow(o, 100 + i)
        for o in owners:
            kv.free(o)

    benchmark(churn)


@pytest.mark.parametrize("name", ["static", "inflight", "overlap"])
def test_iteration_host_overhead(benchmark, name):
    """Host time of whole runs (schedule + prepare + postprocess) per iteration, from the records."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg)
    from strategies.runtime.engine import script_model
    from tests.util import ListSource

    scripted = script_model(model)
    ec = ExecutorConfig(max_batch_size=32, max_seq_len=128)

    def run():
        s = get_strategy(name)(cfg, scripted, ec)
        try:
            s.run(ListSource(_requests(64, prompt=32)))
        finally:
            s.close()
        host = [(r.schedule_end_s - r.schedule_start_s) + (r.prepare_end_s - r.prepare_start_s)
                + (r.postprocess_end_s - r.postprocess_start_s) for r in s.records]
        return float(np.mean(host))

    host_s = benchmark.pedantic(run, rounds=3)
    benchmark.extra_info["host_ms_per_iteration"] = host_s * 1e3


@pytest.mark.parametrize("enabled", [True, False])
def test_nvtx_phase_range_without_a_tool(benchmark, enabled):
    """One phase range through the helper, NVTX on (no tool attached) and off."""
    n = Nvtx(enabled)

    def phase():
        n.push("schedule")
        n.pop()

    benchmark(phase)


def test_iteration_record(benchmark):
    """What one iteration's record costs the host: construction and the fields a step fills."""
    from strategies.runtime.iteration import ITERATION_COLUMNS, IterationRecord

    def record():
        rec = IterationRecord(1)
        for name in ITERATION_COLUMNS[1:]:
            setattr(rec, name, 1)
        return rec

    benchmark(record)
