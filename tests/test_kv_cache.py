"""The paged KV cache: storage sized by --kv-blocks, block tables, prefix reuse, and the scheduler
behaviours that depend on blocks (decodes first, the watermark, what static and overlap really hold)."""

import json
from collections import deque
from functools import partial

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.runner import build_requests
from harness.traces import Fit, fit_trace, load_trace, synthetic_trace, trace_info
from harness.traces.prompts import ideal_prefix_hit_rate
from harness.traces.trace import TraceRequest
from strategies.config import ExecutorConfig
from strategies.registry import PEERS, get_strategy, strategy_names
from strategies.running import RunningRequests
from strategies.runtime.batch import ContextChunk, GenerationStep, ScheduledBatch
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.kv.free_blocks import FreeBlocks
from strategies.runtime.progress import SlotProgress
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams
from strategies.scheduler import IterationScheduler
from tests.util import TINY64, Queues, make_requests, reference_decode, run_strategy, tiny_models
from tests.util import cli as run_cli

cli = partial(run_cli, timeout=600)  # whole runs

# Every in-process strategy; the pipeline's stage processes take seconds to start per run, so its prefix
# caching is held to the in-flight strategy's tokens in tests/test_pipeline.py, on one long-lived pipeline.
STRATEGIES = [s for s in strategy_names() if s not in PEERS and s != "pipeline"]


def req(tokens, max_new=4, rid="r"):
    return Request(rid, np.asarray(tokens, dtype=np.int64), max_new)


# --- storage --------------------------------------------------------------------------------------
def test_pool_holds_exactly_what_kv_blocks_says():
    _, scripted = tiny_models()
    s = get_strategy("inflight")(TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=64, kv_blocks=37,
                                                                   tokens_per_block=8))
    try:
        # tiny: 2 layers x 2 KV heads x head_dim 16, float64 (8 bytes), keys and values
        assert s.engine.kv.nbytes == 37 * 8 * (2 * 2 * 2 * 16 * 8)
    finally:
        s.close()


# --- the block manager ----------------------------------------------------------------------------
def test_blocks_are_shared_by_reference_and_cached_blocks_outlive_their_request():
    kv = BlockManager(num_blocks=6, tokens_per_block=4, num_slots=3, max_blocks_per_seq=4, prefix_caching=True)
    a = req(range(10, 22))  # 12 tokens: 3 full blocks
    kv.admit(0, kv.prefix_hit(a), 12)
    a.num_computed_tokens = 12
    kv.commit(0, a)
    b = req([*list(range(10, 22)), 99])  # same 12, one more
    hits = kv.prefix_hit(b)
    assert hits == list(kv.table[0, :3])  # the longest cached prefix: all three full blocks
    kv.admit(1, hits, 13)
    assert kv.blocks_in_use == 4  # three shared + one of its own
    kv.release(0, a)
    assert kv.blocks_in_use == 4 and kv.cached_free_blocks == 0  # b still holds the shared three
    kv.release(1, b)
    assert kv.blocks_in_use == 0 and kv.cached_free_blocks == 3 and kv.free_blocks == 6
    # a prompt that is exactly cached reuses all but its last block: its last token is always computed
    assert len(kv.prefix_hit(req(range(10, 22)))) == 2


def test_never_cached_blocks_go_first_then_the_least_recent_tail():
    kv = BlockManager(num_blocks=4, tokens_per_block=2, num_slots=2, max_blocks_per_seq=4, prefix_caching=True)
    a = req(range(1, 7))  # 3 full blocks
    kv.admit(0, [], 6)
    a.num_computed_tokens = 6
    first = list(kv.table[0, :3])
    kv.release(0, a)  # all three cached, one never-used block free
    kv.admit(1, [], 2)  # takes the never-cached block
    assert kv.evictions == 0 and kv.table[1, 0] not in first
    kv.grow(1, 4)  # now it must evict: the tail block of a goes first
    assert kv.evictions == 1 and kv.table[1, 1] == first[2]
    assert kv.prefix_hit(req(range(1, 7), rid="again")) == first[:2]  # the head of the chain survives


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_free_blocks_hand_out_ids_in_a_deques_order(num_blocks, moves):
    """The ring array gives out and takes back ids in a deque's FIFO order, across its wrap-around."""
    free, model = FreeBlocks(num_blocks), deque(range(num_blocks))
    held: list[int] = []
    for take, k in moves:
        if take:
            k = min(k, len(model))
            got = free.take(k)
            assert got.tolist() == [model.popleft() for _ in range(k)]
            held += got.tolist()
        else:  # give back the k most recently taken, last first (a release gives back tail blocks first)
            back = held[len(held) - min(k, len(held)):][::-1]
            del held[len(held) - len(back):]
            free.put(np.array(back, dtype=np.int64))
            model.extend(back)
        assert len(free) == len(model)
    assert free.take(len(model)).tolist() == list(model)
    with pytest.raises(RuntimeError):
        free.take(1)


def test_only_full_blocks_of_known_and_computed_tokens_are_cached():
    kv = BlockManager(num_blocks=8, tokens_per_block=4, num_slots=2, max_blocks_per_seq=4, prefix_caching=True)
    a = req(range(1, 11), max_new=6)  # 10 tokens
    kv.admit(0, [], 16)
    a.num_computed_tokens = 6  # launched so far: one full block
    kv.commit(0, a)
    assert len(kv.prefix_hit(req(range(1, 11), rid="b"))) == 1
    a.num_computed_tokens = 12  # the keys of two outputs the host has not read yet (overlap)
    kv.commit(0, a)
    assert len(kv.prefix_hit(req(range(1, 11), rid="c"))) == 2  # block 3 needs tokens the host lacks


# --- prefix caching changes no token --------------------------------------------------------------
prefix_st = st.lists(st.integers(3, 511), min_size=4, max_size=24)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Found by this test in CI: static batching counted a cached block as a hit of its second row, then its
# first row's admission evicted that block for itself; the second row read the first's keys
@example(prefixes=[[3, 3, 3, 4], [3, 3, 461, 3, 3, 3, 3, 3], [3] * 10],
         rows=[(0, [3], 1, False), (0, [3], 1, False), (1, [3], 2, False), (0, [3, 3, 3, 4, 3, 3, 3], 1, False),
               (0, [3] * 10, 15, False), (2, [3], 1, False), (1, [3], 3, False)], kv_blocks=14, max_batch=2)
@given(prefixes=st.lists(prefix_st, min_size=1, max_size=3),
       rows=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(3, 511), min_size=1, max_size=12),
                               st.integers(1, 16), st.booleans()), min_size=2, max_size=10),
       kv_blocks=st.integers(14, 40), max_batch=st.integers(2, 5))
def test_prefix_caching_changes_no_token(prefixes, rows, kv_blocks, max_batch):
    """Shared prefixes under a tight cache (preemption, eviction), every strategy, chunked prefill and
    both policies: tokens equal the one-request-at-a-time reference with and without prefix caching."""
    eager, scripted = tiny_models()
    specs = [(prefixes[g % len(prefixes)] + tail, n, SamplingParams(temperature=0.8, seed=i) if sampled
              else SamplingParams()) for i, (g, tail, n, sampled) in enumerate(rows)]
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    for name in STRATEGIES:
        for policy in ("guaranteed-no-evict", "max-utilization"):
            outcome = {}
            for caching in (False, True):
                cfg = ExecutorConfig(max_batch_size=max_batch, max_seq_len=64, max_num_tokens=32, tokens_per_block=4,
                                     kv_blocks=kv_blocks, chunked_prefill=True, capacity_policy=policy,
                                     prefix_caching=caching)
                reqs = make_requests(specs)
                run_strategy(name, TINY64, scripted, cfg, reqs)
                for r, exp in zip(reqs, expected, strict=True):
                    assert r.status in (Status.FINISHED, Status.REJECTED)
                    if r.status is Status.FINISHED:
                        assert r.output_token_ids == exp, (name, policy, caching, r.request_id)
                assert caching or all(r.cached_tokens == 0 for r in reqs)
                outcome[caching] = [(r.status, r.finish_reason) for r in reqs]
            assert outcome[True] == outcome[False]  # the cache changes what is computed, never what is served


def test_prefix_hits_happen_and_skip_prefill():
    eager, scripted = tiny_models()
    system = list(range(100, 140))  # a 40-token shared prefix: 10 full blocks of 4
    specs = [([*system, 5 + i, 6 + i], 5, SamplingParams()) for i in range(6)]
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    computed = {}
    for caching in (False, True):
        reqs = make_requests(specs)
        cfg = ExecutorConfig(max_batch_size=2, max_seq_len=64, tokens_per_block=4, prefix_caching=caching)
        s = run_strategy("inflight", TINY64, scripted, cfg, reqs)
        assert [r.output_token_ids for r in reqs] == expected
        computed[caching] = sum(rec.num_tokens for rec in s.records)
        if caching:  # the first two arrive together; the other four find the prefix cached
            assert [r.cached_tokens for r in reqs] == [0, 0, 40, 40, 40, 40]
    assert computed[False] - computed[True] == 4 * 40


# --- traces with shared prefixes -------------------------------------------------------------------
def test_mooncake_prompts_share_prefixes_as_their_hash_ids_do(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]}\n'
                 '{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [7, 4]}\n'
                 '{"timestamp": 9, "input_length": 20, "output_length": 3, "hash_ids": [5]}\n')
    trace = load_trace(str(p))
    a, b, c = build_requests(list(trace.requests), SamplingParams(), 4096, seed=0)
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (1100, 700, 20)
    assert np.array_equal(a.prompt_token_ids[:512], b.prompt_token_ids[:512])  # block 7
    assert not np.array_equal(a.prompt_token_ids[512:700], b.prompt_token_ids[512:700])  # 8 vs 4
    scaled = fit_trace(trace, Fit(length_scale=0.1)).requests
    assert scaled[0].prefix_block_len == 51 and scaled[0].input_tokens == 110
    # ideal hit rate by hand, 16-token blocks: b reuses block 7's 512 tokens (32 blocks); a and c nothing
    assert ideal_prefix_hit_rate(trace.requests, 16) == pytest.approx(512 / 1820)


def test_synthetic_shared_prefixes():
    t = synthetic_trace(40, 10, 4, prefix_len=32, num_prefixes=3, seed=1)
    assert all(r.input_tokens == 42 and r.prefix_ids[0] in (0, 1, 2) for r in t.requests)
    reqs = build_requests(list(t.requests), SamplingParams(), 512, seed=1)
    groups = {}
    for r, tr in zip(reqs, t.requests, strict=True):
        groups.setdefault(tr.prefix_ids[0], set()).add(r.prompt_token_ids[:32].tobytes())
    assert len(groups) == 3 and all(len(v) == 1 for v in groups.values())
    # 3 groups x 2 full blocks of 16 are computed once; every later request reuses its group's 32 tokens
    assert ideal_prefix_hit_rate(t.requests, 16) == pytest.approx((40 - 3) * 32 / (40 * 42))


def test_measured_hit_rate_equals_the_ideal_on_mooncake(tmp_path, shared_traces):
    """Sequential requests and a cache larger than the trace: the run must reuse exactly what
    trace-info says an infinite cache could, computed there from hash_ids alone."""
    trace = shared_traces / "mooncake" / "synthetic_trace.jsonl"
    # 512 x 1/32: prefix blocks of 16 tokens, aligned with the KV blocks, so no block mixes prefix
    # tokens with random ones (with the simulator's 512-token vocabulary such a block can match by
    # chance; the straddling arithmetic is checked against brute force below).
    fit = ["--length-scale", "0.03125"]
    info = json.loads(cli("trace-info", str(trace), *fit).stdout)
    out = tmp_path / "m"
    p = cli("run", "--device", "sim", "--trace", str(trace), *fit, "--max-concurrency", "1", "--prefix-caching",
            "--strategies", "inflight", "--max-seq-len", "8192", "--max-num-tokens", "8192", "--warmup", "0",
            "--ignore-eos", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    summary = pd.read_csv(out / "summary.csv").iloc[0]
    assert summary["completed"] == 3993 and summary["kv_evictions"] == 0
    assert info["ideal_prefix_hit_rate"] > 0.5
    assert summary["prefix_cache_hit_rate"] == pytest.approx(info["ideal_prefix_hit_rate"], abs=1e-6)
    req = pd.read_parquet(out / "inflight" / "requests.parquet")
    assert req["cached_tokens"].sum() / req["input_tokens"].sum() == pytest.approx(summary["prefix_cache_hit_rate"])


@pytest.mark.parametrize(("block_len", "tpb"), [(15, 16), (6, 4), (16, 16), (40, 16)])
def test_ideal_hit_rate_equals_brute_force_on_tokens(block_len, tpb):
    """The id-based reckoning against the plain one: build every prompt, hash its full blocks, count."""
    rng = np.random.default_rng(block_len)
    trace = []
    for _ in range(120):
        ids = tuple(int(x) for x in rng.integers(0, 4, size=int(rng.integers(1, 6))).cumsum())  # shared chains
        n = int(rng.integers(1, len(ids) * block_len + 12))  # sometimes past the ids: a random tail
        trace.append(TraceRequest(0.0, n, 1, prefix_ids=ids, prefix_block_len=block_len))
    prompts = [r.prompt_token_ids for r in build_requests(trace, SamplingParams(), 2**20, seed=0)]
    seen, hit = set(), 0
    for p in prompts:
        full = [p[: (k + 1) * tpb].tobytes() for k in range(len(p) // tpb)]
        n = 0
        while n < (len(p) - 1) // tpb and full[n] in seen:
            n += 1
        hit += n * tpb
        seen.update(full)
    brute = hit / sum(len(p) for p in prompts)
    assert brute > 0.1
    assert ideal_prefix_hit_rate(trace, tpb) == pytest.approx(brute, abs=1e-12)


def test_trace_info_on_the_real_mooncake_trace(shared_traces):
    info = trace_info(load_trace(str(shared_traces / "mooncake" / "synthetic_trace.jsonl")), 16)
    assert 0.5 < info["ideal_prefix_hit_rate"] < 0.8  # the trace is built around shared prefixes


# --- scheduler realism ----------------------------------------------------------------------------
def test_running_decodes_get_their_token_before_any_prefill_chunk():
    cfg = ExecutorConfig(max_batch_size=4, max_num_tokens=16, max_seq_len=256, chunked_prefill=True)
    kv = BlockManager(cfg.total_kv_blocks, cfg.tokens_per_block, 4, cfg.max_blocks_per_seq)
    long, short = req(range(1, 201), 8, "long"), req(range(1, 5), 8, "short")
    book, running = SlotProgress(4), RunningRequests(4)
    for slot, r in enumerate((long, short)):  # the long prompt was admitted first and is mid-prefill
        r.admit(slot, slot, book=book)
        kv.admit(slot, [], r.prompt_len + r.max_new_tokens)
        running.append(r)
    long.num_computed_tokens = 48
    short.num_computed_tokens, short.num_output_tokens = 5, 1  # decoding
    batch = IterationScheduler(cfg, kv, book=book).schedule(0, Queues(free_slots=2), running)
    assert [g.request.request_id for g in batch.generation] == ["short"]
    assert [(c.request.request_id, c.length) for c in batch.context] == [("long", 15)]
    assert isinstance(batch.context[0], ContextChunk) and isinstance(batch.generation[0], GenerationStep)


def test_watermark_keeps_max_utilization_from_admitting_what_it_must_preempt():
    _, scripted = tiny_models()
    # A decodes for long; B's prompt fills most of what is left. Without a reserve B is admitted, then
    # preempted as A grows; with a 25% watermark B waits until A is done.
    specs = [(list(range(1, 17)), 40, SamplingParams(ignore_eos=True)),
             (list(range(30, 85)), 20, SamplingParams(ignore_eos=True))]
    preemptions = {}
    for watermark in (0.0, 0.25):
        reqs = make_requests(specs)
        reqs[1].arrival_s = 0.0
        cfg = ExecutorConfig(max_batch_size=2, max_seq_len=96, max_num_tokens=64, tokens_per_block=4, kv_blocks=20,
                             capacity_policy="max-utilization", kv_watermark=watermark)
        run_strategy("inflight", TINY64, scripted, cfg, reqs)
        assert all(r.status is Status.FINISHED for r in reqs)
        preemptions[watermark] = sum(r.preemptions for r in reqs)
    assert preemptions[0.0] > 0 and preemptions[0.25] == 0


def test_a_step_that_preempts_admits_no_one(monkeypatch):
    """vLLM V1's scheduler (``Scheduler.schedule``: ``if not preempted_reqs:`` before the waiting requests): the
    blocks a preemption frees go to the running requests that grow, not to an admission in the same step. With
    prefix caching and a small budget, the victim at the queue's head fits again at once (its freed blocks are
    cached hits, and the budget left asks only a few tokens of it): the old rule re-admitted it in the step that
    preempted it, ten times in this run."""
    _, scripted = tiny_models()
    steps = []
    schedule = IterationScheduler.schedule

    def recording(self, iteration, queues, running):
        batch = schedule(self, iteration, queues, running)
        steps.append((len(batch.preempted), len(batch.admitted)))
        return batch

    monkeypatch.setattr(IterationScheduler, "schedule", recording)
    reqs = make_requests([(list(range(1 + i, 9 + i)), 24, SamplingParams(ignore_eos=True)) for i in range(10)])
    for i, r in enumerate(reqs):
        r.arrival_s = 0.0 if i < 4 else 1e-3 * i
    cfg = ExecutorConfig(max_batch_size=6, max_seq_len=64, max_num_tokens=6, tokens_per_block=4, kv_blocks=16,
                         capacity_policy="max-utilization", prefix_caching=True)
    run_strategy("inflight", TINY64, scripted, cfg, reqs)
    assert all(r.status is Status.FINISHED for r in reqs)
    preempting = [admitted for preempted, admitted in steps if preempted]
    assert len(preempting) > 5 and not any(preempting), steps


def test_static_holds_the_blocks_its_padding_and_finished_rows_write():
    _, scripted = tiny_models()
    specs = [(list(range(1, 5)), 2, SamplingParams(ignore_eos=True)), (list(range(1, 21)), 10,
                                                                        SamplingParams(ignore_eos=True))]
    s = run_strategy("static", TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=64, tokens_per_block=4),
                     make_requests(specs))
    # padded to 20; the batch decodes for the longer request's outputs: row 0 writes up to position
    # max(20, 4 + 10) - 1 (5 blocks), row 1 up to 20 + 10 - 1 (8 blocks)
    assert s.records[0].kv_blocks_used == 5 + 8
    assert s.records[0].num_padding_tokens == 16
    assert sum(r.num_padding_tokens for r in s.records[1:]) == 8  # row 0 computed for nothing 8 times


@pytest.mark.parametrize("name", ["inflight", "overlap"])
def test_overlap_counts_its_extra_row_after_a_stop_as_padding(name):
    eager, scripted = tiny_models()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, size=8).tolist() for _ in range(8)]
    free = make_requests([(p, 30, SamplingParams(ignore_eos=True)) for p in prompts])
    # each request stops at the token it would produce at step 2..7
    stops = [reference_decode(eager, TINY64, r)[2 + i % 6] for i, r in enumerate(free)]
    reqs = make_requests([(p, 30, SamplingParams(stop_token_ids=(t,))) for p, t in zip(prompts, stops, strict=True)])
    s = run_strategy(name, TINY64, scripted, ExecutorConfig(max_batch_size=8, max_seq_len=64), reqs)
    stopped_early = sum(1 for r in reqs if r.finish_reason == "stop" and r.num_output_tokens < r.max_new_tokens)
    assert stopped_early >= 3
    padding = sum(r.num_padding_tokens for r in s.records)
    assert padding == (stopped_early if name == "overlap" else 0)


def test_allocate_preempts_each_victim_once_from_a_callers_selection():
    """The pipeline schedules only the requests not in flight and passes that selection as ``running``;
    a prefill chunk that needs more blocks than one victim frees makes the scheduler pick again. Each
    pick must be a new victim, newest first (it once picked the same one forever: a hang in CI)."""

    class Pool:  # a KV pool where each preemption frees one block and the chunk needs three
        total_blocks, tokens_per_block, free = 16, 4, 0

        def allocate(self, slot: int, tokens: int) -> list[int] | None:
            return [0, 1, 2] if self.free >= 3 else None

    pool = Pool()
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64, capacity_policy="max-utilization")
    scheduler = IterationScheduler(cfg, pool, book=SlotProgress(4))  # type: ignore[arg-type]
    reqs = [Request(f"r{i}", np.arange(3, 10), 4, SamplingParams()) for i in range(4)]
    for i, r in enumerate(reqs):
        r.admit(i, i, 0)
    preempted: list[Request] = []

    def preempt(victim: Request) -> None:  # as the executor does, on its own list, not the selection
        assert victim not in preempted, f"{victim.request_id} preempted twice"
        preempted.append(victim)
        pool.free += 1

    selection = list(reqs)
    batch = ScheduledBatch(0)
    assert scheduler._allocate(reqs[0], 40, selection, batch, preempt)
    assert [r.request_id for r in preempted] == ["r3", "r2", "r1"] == [r.request_id for r in batch.preempted]
