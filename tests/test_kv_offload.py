"""The host KV tier (--kv-offload-blocks): cached blocks the GPU pool evicts go to host memory and come back on a
prefix hit — the same tokens with it on and off under every strategy and memory mode, the ideal hit rate on a
trace whose prefixes the GPU pool cannot keep, and copies priced no faster than the host link."""

from functools import partial

import pandas as pd
import pytest

from strategies.config import ExecutorConfig
from strategies.registry import PEERS, get_strategy, strategy_names
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.kv.host_pool import KVHostPool
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from strategies.runtime.sim.specs import GPUS, resolve_model_spec
from tests.util import TINY64, ListSource, make_requests, reference_decode, run_strategy, tiny_models
from tests.util import cli as run_cli

cli = partial(run_cli, timeout=600)
STRATEGIES = [s for s in strategy_names() if s not in PEERS and s != "pipeline"]  # the pipeline: its own test


def _req(tokens: list[int], rid: str = "r") -> Request:
    import numpy as np

    return Request(rid, np.asarray(tokens, dtype=np.int64), 4, SamplingParams())


# --- the book ------------------------------------------------------------------------------------------
def test_an_evicted_block_goes_to_the_host_tier_and_a_hit_there_comes_back_in_a_fresh_block():
    kv = BlockManager(num_blocks=4, tokens_per_block=2, num_slots=2, max_blocks_per_seq=4, prefix_caching=True,
                      host_blocks=8)
    a = _req([1, 2, 3, 4, 5], "a")  # two full blocks, then a token
    kv.admit(0, kv.prefix_hit(a), 5)
    a.num_computed_tokens = 5
    kv.release(0, a)  # its two full blocks stay cached, held by nobody
    assert kv.take_copies() == ([], [])
    b = _req([9, 9, 8, 8, 7, 7, 6], "b")  # needs all 4 blocks: both of a's cached ones are evicted
    kv.admit(1, kv.prefix_hit(b), 7)
    evicted = set(kv.tables[0, 0, :2].tolist())  # (a's row still lists them)
    offloads, onloads = kv.take_copies()
    assert {g for g, _ in offloads} == evicted and not onloads and kv.host.used_blocks == 2
    a_on_host = {h for _, h in offloads}
    b.num_computed_tokens = 7
    kv.release(1, b)
    a2 = _req([1, 2, 3, 4, 6], "a2")  # a's two blocks again: only the host tier holds them
    hits = kv.prefix_hit(a2)
    assert len(hits) == 2 and all(h < 0 for h in hits)
    assert kv.admission_blocks(hits, 5) == 3  # a fresh block for each host hit, one for the new token
    kv.admit(0, hits, 5, hashes=a2.block_hashes)
    offloads, onloads = kv.take_copies()
    assert [g for _, g in onloads] == kv.tables[0, 0, :2].tolist()  # into the blocks the row lists, in order
    assert {h for h, _ in onloads} == a_on_host  # from where a's blocks went
    assert not a_on_host & {h for _, h in offloads}  # b's blocks, evicted for them, went elsewhere
    assert a2.host_cached_tokens == 0  # (the scheduler counts a request's host hits; the book only moves blocks)
    assert kv.prefix_hit(_req([1, 2, 3, 4, 9])) == kv.tables[0, 0, :2].tolist()  # now GPU hits again


def test_the_host_tier_evicts_its_least_recent_block_never_one_this_step_reads():
    kv = BlockManager(num_blocks=2, tokens_per_block=2, num_slots=1, max_blocks_per_seq=2, prefix_caching=True,
                      host_blocks=2)
    host = kv.host
    for h, g in ((11, 0), (12, 1)):
        host.store(h, g)
    host.take_copies()
    host.keep([host.lookup(11)])  # an onload this step reads hash 11's block
    host.store(13, 0)  # the tier is full: 12 goes (11 is older, but being read)
    assert host.lookup(12) is None and host.lookup(11) is not None and host.lookup(13) is not None
    host.keep([host.lookup(11), host.lookup(13)])
    host.store(14, 1)  # nothing can go: the block's keys are dropped, never written over a source
    assert host.lookup(14) is None and host.dropped_blocks == 1
    host.take_copies()
    host.store(14, 1)  # the next step: 11 is the least recent now
    assert host.lookup(11) is None and host.lookup(14) is not None


# --- tokens --------------------------------------------------------------------------------------------
def _prefix_specs(groups: int = 3, per_group: int = 4) -> list:
    """Requests cycling through ``groups`` shared 24-token prefixes: with room for one request and a half, a group's
    blocks are evicted by the others before its next request comes."""
    prefixes = [[50 + 7 * g + i for i in range(24)] for g in range(groups)]
    return [(prefixes[i % groups] + [200 + i, 201 + i], 6, SamplingParams()) for i in range(groups * per_group)]


def _config(**kw) -> ExecutorConfig:
    return ExecutorConfig(**{"max_batch_size": 2, "max_seq_len": 64, "max_num_tokens": 32, "tokens_per_block": 4,
                             "kv_blocks": 12, "capacity_policy": "max-utilization", "prefix_caching": True, **kw})


@pytest.mark.parametrize("memory", ["shared", "split"])
def test_tokens_equal_the_reference_with_the_tier_under_every_strategy(memory):
    eager, scripted = tiny_models()
    specs = _prefix_specs()
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    for name in STRATEGIES:
        for blocks in (0, 64):
            reqs = make_requests(specs)
            s = run_strategy(name, TINY64, scripted, _config(device_memory=memory, kv_offload_blocks=blocks), reqs)
            assert [r.output_token_ids for r in reqs] == expected, (name, blocks)
            onloaded = sum(rec.kv_onloaded_blocks for rec in s.records)
            host_hits = sum(r.host_cached_tokens for r in reqs)
            if blocks:  # the tier served hits: their keys came back through the copies
                assert onloaded > 0 and host_hits > 0, name
                assert sum(rec.kv_offloaded_blocks for rec in s.records) > 0
            else:
                assert onloaded == 0 and host_hits == 0


@pytest.mark.parametrize("name", ["static", "overlap"])
def test_tokens_equal_transformers_greedy_with_hits_from_the_tier(hf_checkpoint, name):
    """A Hugging Face checkpoint, prompts sharing prefixes under a pool too small to keep them: with hits served
    from the host tier, every request's tokens are ``LlamaForCausalLM.generate``'s greedy ones."""
    import json

    import torch

    from strategies.runtime.models.checkpoint import config_from_hf, load_checkpoint
    from strategies.runtime.models.llama import script_model

    path, hf_model = hf_checkpoint
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    specs = [(p, 6, SamplingParams(ignore_eos=True)) for p, _, _ in _prefix_specs()]
    reqs = make_requests(specs)
    run_strategy(name, cfg, script_model(load_checkpoint(path, cfg)), _config(kv_offload_blocks=64), reqs)
    assert sum(r.host_cached_tokens for r in reqs) > 0
    for (p, n, _), r in zip(specs, reqs, strict=True):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
        assert r.output_token_ids == ref[0, len(p):].tolist(), r.request_id


def test_a_tier_whose_onloads_copy_nothing_is_caught_by_the_tokens(monkeypatch):
    """The token test above can fail: onloads that leave the GPU blocks as they were give other tokens."""
    def offload_only(self, out_gpu, out_host, in_host, in_gpu, k, v):
        move(self, out_gpu, out_host, [], in_gpu[:0], k, v)

    move = KVHostPool.move
    monkeypatch.setattr(KVHostPool, "move", offload_only)
    eager, scripted = tiny_models()
    specs = _prefix_specs()
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    reqs = make_requests(specs)
    run_strategy("inflight", TINY64, scripted, _config(kv_offload_blocks=64, cpu_device="thread"), reqs)
    assert sum(r.host_cached_tokens for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] != expected


def test_pipeline_stages_each_move_their_layers_blocks():
    eager, scripted = tiny_models()
    specs = _prefix_specs()
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    s = get_strategy("pipeline")(TINY64, scripted, _config(kv_offload_blocks=64, pipeline_stages=2))
    try:
        reqs = make_requests(specs)
        s.run(ListSource(reqs))
    finally:
        s.close()
    assert [r.output_token_ids for r in reqs] == expected
    assert sum(rec.kv_onloaded_blocks for rec in s.records) > 0
    # the stages copy inside their timed forward: the copies' time is unknown, not 0
    from harness.metrics import engine_metrics
    from harness.output.records import iterations_frame

    metrics = engine_metrics(iterations_frame(s.records), 2)
    assert metrics["kv_onloaded_blocks"] > 0 and metrics["kv_host_copy_wait_s"] != metrics["kv_host_copy_wait_s"]


def test_the_tier_needs_prefix_caching_and_a_size_of_at_least_zero():
    with pytest.raises(ValueError, match="needs --prefix-caching"):
        ExecutorConfig(kv_offload_blocks=8)
    with pytest.raises(ValueError, match=">= 0"):
        ExecutorConfig(kv_offload_blocks=-1, prefix_caching=True)
    p = cli("run", "--model", "tiny", "--num-prompts", "2", "--kv-offload-blocks", "8", "--no-progress")
    assert p.returncode != 0 and "needs --prefix-caching" in p.stderr and "Traceback" not in p.stderr


# --- on the simulated device, a trace whose prefixes the GPU pool cannot keep --------------------------
def test_a_large_enough_tier_reaches_the_ideal_hit_rate_and_lowers_ttft(tmp_path, shared_traces):
    """Mooncake's prefixes, requests one at a time: a 400-block GPU pool loses most of them, a host tier the size
    of the trace keeps every one (trace-info's ideal hit rate exactly); TTFT falls, and every step's copies take
    at least their bytes over the GPU's PCIe link."""
    import json

    trace = shared_traces / "mooncake" / "synthetic_trace.jsonl"
    fit = ["--length-scale", "0.03125"]  # 16-token prefix blocks, as in tests/test_kv_cache.py
    ideal = json.loads(cli("trace-info", str(trace), *fit).stdout)["ideal_prefix_hit_rate"]
    base = ["run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-3-8b", "--trace", str(trace), *fit,
            "--max-concurrency", "1", "--prefix-caching", "--strategies", "inflight", "--max-seq-len", "8192",
            "--max-num-tokens", "8192", "--kv-blocks", "400", "--host-time", "modelled", "--ignore-eos", "--warmup",
            "0", "--no-progress"]
    summary = {}
    for blocks in (0, 100_000):
        out = tmp_path / str(blocks)
        p = cli(*base, "--kv-offload-blocks", str(blocks), "--out", str(out))
        assert p.returncode == 0, p.stderr
        summary[blocks] = pd.read_csv(out / "summary.csv").iloc[0]
    off, on = summary[0], summary[100_000]
    assert off["completed"] == on["completed"] == 3993
    assert off["kv_evictions"] > 0 and off["prefix_cache_hit_rate"] < ideal - 0.2
    assert on["prefix_cache_hit_rate"] == pytest.approx(ideal, abs=1e-6)
    assert 0 < on["host_cache_hit_rate"] < on["prefix_cache_hit_rate"]
    assert on["mean_ttft_ms"] < off["mean_ttft_ms"]
    # the report draws the tier's occupancy beside the GPU pool's, where there is a tier
    assert "Host KV tier" in (tmp_path / "100000" / "report.html").read_text()
    assert "Host KV tier" not in (tmp_path / "0" / "report.html").read_text()
    # the link, from the spec and the datasheet alone: bytes a block, PCIe Gen5 x16's 63 GB/s each way
    spec = resolve_model_spec("llama-3-8b")
    block = 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * 2 * 16
    it = pd.read_parquet(tmp_path / "100000" / "inflight" / "iterations.parquet")
    moved = it[it["kv_host_copy_end_s"].notna()]
    blocks_moved = moved["kv_offloaded_blocks"] + moved["kv_onloaded_blocks"]
    assert (moved["kv_onloaded_bytes"] == moved["kv_onloaded_blocks"] * block).all()
    assert ((moved["kv_host_copy_end_s"] - moved["kv_host_copy_start_s"]) >= blocks_moved * block / 63.1e9).all()
    assert GPUS["h100"].host_link_bw == pytest.approx(63.0e9, rel=1e-3)
    assert on["kv_onloaded_blocks"] == it["kv_onloaded_blocks"].sum() > 0
    # the forward waits for every copy, whole
    wait = (moved["forward_start_s"] - moved["kv_host_copy_start_s"]).sum()
    assert on["kv_host_copy_wait_s"] == pytest.approx(wait, rel=1e-6)


def test_every_steps_compute_waits_for_its_copies_under_overlap_too(tmp_path, shared_traces):
    """The simulated copy engine, ordered as TensorRT-LLM orders its copy streams: a step's copies start once the
    step before is done (even under overlap, which launches it while that one runs), and its compute starts when
    they have ended. The same copies under both strategies, every one waited for."""
    trace = shared_traces / "mooncake" / "synthetic_trace.jsonl"
    out = tmp_path / "r"
    p = cli("run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-3-8b", "--trace", str(trace), "--limit",
            "300", "--max-input-len", "7000", "--prefix-caching", "--strategies", "inflight,overlap", "--max-seq-len",
            "8192", "--max-num-tokens", "8192", "--kv-blocks", "2000", "--kv-offload-blocks", "100000", "--host-time",
            "modelled", "--host-ms-per-iteration", "0.3", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    summary = pd.read_csv(out / "summary.csv").set_index("strategy")
    assert summary.loc["inflight", "kv_onloaded_blocks"] == summary.loc["overlap", "kv_onloaded_blocks"] > 0
    for name in ("inflight", "overlap"):
        it = pd.read_parquet(out / name / "iterations.parquet")
        copied = it[it["kv_host_copy_start_s"].notna()]
        previous_end = it["sample_end_s"].shift()[copied.index]
        assert (copied["kv_host_copy_start_s"] >= previous_end.fillna(0)).all(), name  # after the step before
        assert (copied["forward_start_s"] >= copied["kv_host_copy_end_s"]).all(), name  # compute after the copies
        copy_s = (copied["kv_host_copy_end_s"] - copied["kv_host_copy_start_s"]).sum()
        assert summary.loc[name, "kv_host_copy_wait_s"] == pytest.approx(copy_s, rel=1e-9)


def test_served_metrics_count_the_tiers_hits_as_vllm_counts_its_connectors():
    """vLLM counts a KV connector's hits apart: ``prefix_cache_*`` the GPU cache's, ``external_prefix_cache_*`` the
    connector's, queried over the prompt tokens the GPU's cache did not hold — and exports them only with one."""
    from prometheus_client import generate_latest

    from harness.serve.metrics import ServerMetrics

    r = _req(list(range(48)))
    r.cached_tokens, r.host_cached_tokens = 32, 16  # 16 from the GPU's cache, 16 onloaded from the host tier
    values = {}
    for tier in (False, True):
        m = ServerMetrics("m", host_tier=tier)
        m.tokens(r, True, [r.arrival_s + 0.1], None)
        values[tier] = {line.split("{")[0]: float(line.split()[-1]) for line in generate_latest(m.registry).decode()
                        .splitlines() if line.startswith("vllm:") and "_created" not in line}
    on = values[True]
    assert on["vllm:prefix_cache_queries_total"] == 48 and on["vllm:prefix_cache_hits_total"] == 16
    assert on["vllm:external_prefix_cache_queries_total"] == 32 and on["vllm:external_prefix_cache_hits_total"] == 16
    assert not any(k.startswith("vllm:external") for k in values[False])


def test_the_tier_sized_in_gib_as_vllm_sizes_it(tmp_path):
    """``--kv-offloading-size`` (vLLM's option, GiB over every rank): Llama-3-8B's KV is 128 KiB a token (32 layers,
    8 KV heads of 128, keys and values in bf16), so 1 GiB holds 512 blocks of 16 tokens."""
    import json

    out = tmp_path / "g"
    p = cli("run", "--device", "sim", "--model-spec", "llama-3-8b", "--num-prompts", "4", "--prefix-caching",
            "--kv-offloading-size", "1", "--strategies", "inflight", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "run.json").read_text())["executor"]["kv_offload_blocks"] == 512
    p = cli("run", "--device", "sim", "--model-spec", "llama-3-8b", "--num-prompts", "4", "--prefix-caching",
            "--kv-offloading-size", "1", "--kv-offload-blocks", "8", "--no-progress", "--out", str(tmp_path / "h"))
    assert p.returncode != 0 and "give one" in p.stderr and "Traceback" not in p.stderr
