"""Micro-benchmarks (pytest-benchmark), each with the bound it must meet.

The test command runs every one once with benchmarking disabled (``--benchmark-disable`` in addopts):
each then times itself (a median of repeats) and asserts its bound, so CI catches a regression without
the full statistics. For real numbers: ``python -m pytest tests/benchmarks --benchmark-only
--benchmark-enable`` (see docs/benchmarks.md). Bounds are ratios to the ``small`` decode step at batch 32, timed
in turn with the function under test (a, step, a, step, ...), so a slower or busier machine moves both
sides of every ratio alike.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import numpy as np
import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.running import RunningRequests
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.buffers.runtime_buffers import RuntimeBuffers
from strategies.runtime.buffers.step_io import StepIO
from strategies.runtime.decoder.sampler import filter_logits, sample
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.kv.paged_attention import generation_attention
from strategies.runtime.models.config import PRESETS
from strategies.runtime.models.llama import Attention, build_model, script_model
from strategies.runtime.progress import SlotProgress
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from strategies.scheduler import IterationScheduler
from tests.util import ListSource, Queues

torch.set_num_threads(1)
pytestmark = pytest.mark.serial  # timings: run alone, after the parallel part
SMALL = PRESETS["small"]


def measure(benchmark, fn, rounds: int = 30, warmup: int = 3, setup=None) -> None:
    """pytest-benchmark's statistics of ``fn(*setup())`` (setup untimed) when it runs (``--benchmark-enable``);
    with it disabled (the test command) only the bound is timed, by ``interleaved``."""
    if benchmark.disabled:
        benchmark(lambda: None)  # the fixture must be used once
        return
    setup = setup or (lambda: ())
    benchmark.pedantic(fn, setup=lambda: (setup(), {}), rounds=rounds, warmup_rounds=warmup)


def interleaved(*fns, rounds: int, warmup: int = 3, setup=None) -> tuple[float, ...]:
    """Median seconds per call of functions timed in turn (a, b, a, b, ...), so that a machine getting
    busier or a cache warming up moves every side of a ratio alike. ``setup`` (untimed) makes the first
    function's arguments for each call."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + rounds):
        for j, (fn, out) in enumerate(zip(fns, times, strict=True)):
            args = setup() if setup is not None and j == 0 else ()
            t = time.perf_counter()
            fn(*args)
            if i >= warmup:
                out.append(time.perf_counter() - t)
    return tuple(statistics.median(out) for out in times)


def _requests(n: int, prompt: int = 128) -> list[Request]:
    return [Request(f"r{i}", np.arange(prompt) % 500, 64, SamplingParams()) for i in range(n)]


@pytest.fixture(scope="module")
def decode_step():
    """The reference: one forward + sample of `small` at batch 32, context ~190, on the device worker, as a
    function (prepare, launch, wait) that each bound times in turn with what it bounds."""
    s = get_strategy("inflight")(SMALL, script_model(build_model(SMALL)), ExecutorConfig(max_batch_size=32,
                                                                                          max_seq_len=512))
    try:
        reqs = [Request(f"r{i}", np.arange(128 + 2 * i) % 4000, 64, SamplingParams()) for i in range(32)]
        for r in reqs:
            s.scheduler.admit(r, [], r.prompt_len + 64)
        batch = ScheduledBatch(0, gen_requests=list(reqs), gen_positions=[r.prompt_len + 30 for r in reqs])
        bufs = s.engine.buffer_sets[0]

        def step() -> None:
            s.engine.prepare(batch, bufs, s.kv.tables)
            s.stream.wait(s.engine.launch(0, bufs))

        for _ in range(5):  # TorchScript's first calls optimise the graph
            step()
        yield step
    finally:
        s.close()


# --- the paged KV cache's decode attention against the dense layout it replaced ---------------------
def _dense_generation(attn: Attention, q, k_cache, v_cache, slots, positions, kmax):
    """The pre-paging decode attention (kept here as the reference): per-slot KV [S, Hkv, seq, D] read
    in place for every slot, the rows that matter picked afterwards."""
    g, num_slots, group = q.size(0), k_cache.size(0), attn.num_heads // attn.num_kv_heads
    qg = q.view(g, attn.num_kv_heads, group, attn.head_dim)
    q_all = torch.zeros((num_slots, attn.num_kv_heads, group, attn.head_dim), dtype=q.dtype)
    q_all[slots] = qg
    pos_all = torch.zeros(num_slots, dtype=positions.dtype)
    pos_all[slots] = positions
    scores = torch.matmul(q_all, k_cache[:, :, :kmax].transpose(-1, -2)) * attn.head_dim ** -0.5
    future = torch.arange(kmax).unsqueeze(0) > pos_all.unsqueeze(1)
    scores = scores.masked_fill(future.view(-1, 1, 1, kmax), float("-inf"))
    o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v_cache.dtype), v_cache[:, :, :kmax])
    return o[slots].reshape(g, attn.num_heads, attn.head_dim)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_decode_attention(benchmark, layout):
    """One layer's decode attention on `small`, batch 32, contexts 128..190: paged ≤ 1.5x dense."""
    attn = Attention(SMALL).eval()
    g, tpb, max_seq, hkv, d = 32, 16, 512, SMALL.num_key_value_heads, SMALL.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(g, SMALL.num_attention_heads, d, generator=gen)
    positions = torch.arange(128, 128 + 2 * g, 2)
    kmax = int(positions.max()) + 1
    dense_k = torch.randn(g, hkv, max_seq, d, generator=gen)
    dense_v = torch.randn(g, hkv, max_seq, d, generator=gen)
    blocks = torch.randperm(g * max_seq // tpb, generator=gen).view(g, max_seq // tpb)  # scattered pages
    pool_k = torch.empty(hkv, g * max_seq, d)
    pool_v = torch.empty(hkv, g * max_seq, d)
    pages = (blocks.repeat_interleave(tpb, 1) * tpb + torch.arange(max_seq) % tpb)  # [G, seq]
    pool_k[:, pages.flatten()] = dense_k.transpose(0, 1).reshape(hkv, -1, d)
    pool_v[:, pages.flatten()] = dense_v.transpose(0, 1).reshape(hkv, -1, d)
    gen_kv = pages[:, :kmax].flatten()
    hidden = (torch.arange(kmax).unsqueeze(0) > positions.unsqueeze(1)).view(1, g, 1, kmax)
    gen_mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))  # as LlamaModel.step builds it
    slots = torch.arange(g)
    with torch.inference_mode():
        dense = _dense_generation(attn, q, dense_k, dense_v, slots, positions, kmax)
        paged = generation_attention(q, pool_k, pool_v, gen_kv, gen_mask)
        torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-5)  # the same attention
        both = {"dense": lambda: _dense_generation(attn, q, dense_k, dense_v, slots, positions, kmax),
                "paged": lambda: generation_attention(q, pool_k, pool_v, gen_kv, gen_mask)}
        measure(benchmark, both[layout], rounds=60)
        paged_s, dense_s = interleaved(both["paged"], both["dense"], rounds=60)
    benchmark.extra_info["paged_over_dense"] = paged_s / dense_s
    assert paged_s <= 1.5 * dense_s, f"paged {paged_s * 1e6:.0f} us vs dense {dense_s * 1e6:.0f} us"


# --- host-side work per iteration, against the device step it feeds ---------------------------------
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("mode", ["greedy", "top-p"])
def test_sampler(benchmark, batch, mode, decode_step):
    """The sampler at `small`'s vocabulary (and 32k at batch 256): greedy within 10% of a step of the
    same batch; top-p's filters need the vocabulary sorted (HF's semantics), and cost at most half again
    that sort plus 5% of a step in fixed costs."""
    vocab = 32000 if batch == 256 else SMALL.vocab_size
    logits = torch.randn(batch, vocab)
    temp = torch.full((batch,), 0.0 if mode == "greedy" else 0.8)
    top_k, top_p, min_p = torch.zeros(batch, dtype=torch.long), torch.full((batch,), 0.9), torch.zeros(batch)
    seeds, steps = torch.arange(batch), torch.zeros(batch, dtype=torch.long)
    filters = random = mode == "top-p"

    def run():
        sample(logits, temp, top_k, top_p, min_p, seeds, steps, filters, random)

    if mode == "greedy":
        measure(benchmark, run, rounds=10)
        t, step = interleaved(run, decode_step, rounds=10)
        budget = 0.1 * step * max(1.0, batch / 32) * vocab / SMALL.vocab_size
    else:
        measure(benchmark, run, rounds=10)  # pytest-benchmark's statistics of the whole filtered sampler
        # The filters against the sort, timed in turn. Not as (filtered sampler - plain sampler): that
        # difference of two noisy ~1 s figures moved by 30% between runs at batch 256.
        scaled = logits / temp.unsqueeze(1)
        t, sort, step = interleaved(lambda: filter_logits(scaled, top_k, top_p, min_p),
                                    lambda: torch.sort(logits, dim=-1, descending=True), decode_step,
                                    rounds=5 if batch == 256 else 20, warmup=1)
        budget = 1.5 * sort + 0.05 * step  # the filters' dozen fixed-cost ops
    assert t <= budget, f"{t * 1e3:.2f} ms > {budget * 1e3:.2f} ms"


@pytest.mark.parametrize("rows", [8, 64, 256])
def test_buffer_preparation(benchmark, rows, decode_step):
    """Host-side fill of runtime buffers + step I/O for one generation step: ≤ 5% of a batch-32 step
    per 32 rows."""
    memory = DeviceMemory(torch.device("cpu"), split=True)
    rb = RuntimeBuffers(4096, rows, 512, 16, 32000, memory)
    io = StepIO(rows, 8, memory, np.zeros((rows, 2), dtype=bool))
    kv = BlockManager(rows * 32, 16, rows, 32)
    reqs = _requests(rows)
    for i, r in enumerate(reqs):
        r.admit(i, i)
        kv.admit(i, [], 192)
        r.num_computed_tokens = r.prompt_len
    batch = ScheduledBatch(0, gen_requests=list(reqs), gen_positions=[r.prompt_len for r in reqs])

    def prepare():
        order = batch.sampled_requests
        rb.fill(batch, kv.tables, order)
        io.fill(order, batch.admitted, 2)

    measure(benchmark, prepare, rounds=50)
    t, step = interleaved(prepare, decode_step, rounds=30)
    assert t <= 0.05 * step * max(1.0, rows / 32)


@pytest.mark.parametrize("waiting", [1, 32, 512])
def test_scheduler_step(benchmark, waiting, decode_step):
    """One in-flight schedule admitting into 64 slots from a queue of ``waiting``: ≤ 10% of a step."""
    cfg = ExecutorConfig(max_batch_size=64, max_num_tokens=4096, max_seq_len=512)

    def setup():
        kv = BlockManager(cfg.total_kv_blocks, cfg.tokens_per_block, 64, cfg.max_blocks_per_seq)
        return IterationScheduler(cfg, kv, book=SlotProgress(64)), deque(_requests(waiting, prompt=48)), list(range(64))

    def step(sched, queue, free):
        running = RunningRequests(64)

        def admit(r, hits, reserve):
            slot = free.pop()
            r.admit(slot, 0, book=sched.book)
            sched.kv.admit(slot, hits, reserve)
            running.append(r)

        queues = Queues(free_slots=len(free), admit=admit)
        queues.waiting = queue
        sched.schedule(0, queues, running)

    measure(benchmark, step, rounds=20, setup=setup)
    t, decode = interleaved(step, decode_step, rounds=60, setup=setup)
    assert t <= 0.1 * decode


@pytest.mark.parametrize("caching", [False, True])
def test_block_manager_churn(benchmark, caching, decode_step):
    """256 requests take blocks for ~200 tokens and let them go (hashing them when caching): ≤ 10%
    of a step."""
    kv = BlockManager(100_000, 16, 256, 64, prefix_caching=caching)
    reqs = _requests(256, prompt=200)

    def churn():
        for i, r in enumerate(reqs):
            r.block_hashes.clear()
            kv.admit(i, kv.prefix_hit(r), 100 + i)
            r.num_computed_tokens = r.prompt_len
        for i, r in enumerate(reqs):
            kv.release(i, r)

    measure(benchmark, churn, rounds=10)
    t, step = interleaved(churn, decode_step, rounds=10)
    assert t <= 0.1 * step * 8


@pytest.mark.parametrize("name", ["static", "inflight", "overlap"])
def test_iteration_host_overhead(benchmark, name, decode_step):
    """Host time (schedule + prepare + postprocess) per iteration of whole runs: ≤ 25% of a step."""
    cfg = PRESETS["tiny"]
    scripted = script_model(build_model(cfg))
    ec = ExecutorConfig(max_batch_size=32, max_seq_len=128)
    host: list[float] = []

    def run():
        s = get_strategy(name)(cfg, scripted, ec)
        try:
            s.run(ListSource(_requests(64, prompt=32)))
        finally:
            s.close()
        host.append(float(np.mean([(r.schedule_end_s - r.schedule_start_s) + (r.prepare_end_s - r.prepare_start_s)
                                   + (r.postprocess_end_s - r.postprocess_start_s) for r in s.records])))

    measure(benchmark, run, rounds=3, warmup=1)
    host.clear()
    _, step = interleaved(run, decode_step, rounds=3, warmup=0)
    benchmark.extra_info["host_ms_per_iteration"] = statistics.median(host) * 1e3
    assert statistics.median(host) <= 0.25 * step


def test_instrumentation_cost(benchmark, decode_step):
    """What one iteration's instrumentation costs the host (six NVTX ranges through the helper with no
    tool attached, and one iteration record): ≤ 1% of a step."""
    from strategies.runtime.iteration import ITERATION_COLUMNS, IterationRecord

    n = Nvtx(True)

    def iteration():
        for name in ("iteration", "schedule", "prepare", "forward", "sample", "postprocess"):
            n.push(name)
            n.pop()
        rec = IterationRecord(1)
        for name in ITERATION_COLUMNS[1:]:
            setattr(rec, name, 1)

    hundred = lambda: [iteration() for _ in range(100)]  # noqa: E731
    measure(benchmark, hundred, rounds=20)
    t, step = interleaved(hundred, decode_step, rounds=20)
    benchmark.extra_info["us_per_iteration"] = t / 100 * 1e6
    assert t / 100 <= 0.01 * step
