"""Disaggregated prefill and decode (strategy ``disagg``) and its equal-GPU baseline (``--num-replicas``).

The references are outside the strategy: each request decoded alone by full recomputation
(``reference_decode``), the in-flight strategy on one engine, the link's datasheet arithmetic for the
simulated transfer time, and the blocks and slots every worker must have back at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.kv_transfer.config import DisaggConfig
from strategies.runtime.kv_transfer.staging import KVStaging, block_bytes
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams
from tests.util import (
    TINY64,
    ListSource,
    assert_accounted,
    child_pids,
    cli,
    make_requests,
    reference_decode,
    run_strategy,
    still_alive,
    tiny_models,
    wait_for_progress,
)


def _specs(n: int = 12, seed: int = 0, prompt: tuple[int, int] = (5, 40)) -> list:
    """Prompts of mixed lengths; every other request samples (seeded), the rest are greedy."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 60, size=int(rng.integers(*prompt))).tolist(), int(rng.integers(1, 20)),
             SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i)) for i in range(n)]


def _config(**kw) -> ExecutorConfig:
    d = {k: kw.pop(k) for k in ("num_prefill_workers", "num_decode_workers", "kv_transfer_buffer_mb",
                                "worker_strategy") if k in kw}
    return ExecutorConfig(**{"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 32, **kw},
                          disagg=DisaggConfig(**{"kv_transfer_buffer_mb": 0.001, **d}))


def _assert_all_returned(s) -> None:
    for w in s.workers:
        assert w.kv.free_blocks == w.kv.total_blocks, (w.label, w.kv.free_blocks)
        assert w.slots.num_free == w.slots.num_slots, w.label


@pytest.mark.parametrize("kw", [
    {},  # a device process per worker, shared memory
    {"device_memory": "split"},  # every copy a transfer on the stream, as on CUDA
    {"cpu_device": "thread"},
    # one process, split memory: the relay's copies are real (the receiver uploads from the sender's host half)
    {"cpu_device": "thread", "device_memory": "split"},
    {"capacity_policy": "max-utilization", "kv_blocks": 6},  # preemption on both sides
    {"prefix_caching": True},  # on the prefill side
    {"chunked_prefill": False, "max_num_tokens": 64},
    {"num_prefill_workers": 2, "num_decode_workers": 2, "kv_transfer_buffer_mb": 1.0},
    # overlap (async scheduling) workers: each launches its next step before it waits for the last
    {"worker_strategy": "overlap"},
    {"worker_strategy": "overlap", "device_memory": "split"},
    {"worker_strategy": "overlap", "capacity_policy": "max-utilization", "kv_blocks": 6},
    {"worker_strategy": "overlap", "num_prefill_workers": 2, "num_decode_workers": 2, "kv_transfer_buffer_mb": 1.0},
], ids=["process", "split", "thread", "thread-split", "preempt", "prefix", "no-chunking", "2p2d", "overlap",
        "overlap-split", "overlap-preempt", "overlap-2p2d"])
def test_tokens_equal_one_request_alone(kw):
    """Greedy and seeded-sampling tokens equal each request decoded alone, and every block and slot of
    every worker is back at the end. The default staging buffer holds one block: transfers take several
    chunks."""
    _, model = tiny_models()
    specs = _specs()
    if kw.get("prefix_caching"):  # a shared 32-token prefix, read from the prefill side's cache
        specs = [([7] * 32 + p[:12], n, s) for p, n, s in specs]
    if kw.get("kv_blocks"):  # 44-60 tokens each (3-4 blocks of 16): any two on one worker outgrow its 6 blocks,
        specs = [(p, 20, s) for p, n, s in _specs(prompt=(24, 41))]  # whatever the workers' timing
    requests = make_requests(specs)
    s = run_strategy("disagg", TINY64, model, _config(**kw), requests, keep_open=True)
    try:
        _assert_all_returned(s)
        if kw.get("device_memory") == "split" and kw.get("cpu_device") == "thread":  # the relay: each decode
            # worker uploaded from the prefill worker's host half, its own never written by the host's loop (it
            # was, before the relay's copies went async; in shared memory a host half is its device half)
            assert all(not w.engine.kv_staging.host.any() for w in s.decode)
    finally:
        s.close()
    assert_accounted(requests)
    assert all(r.status is Status.FINISHED for r in requests)
    for r in requests:
        assert r.output_token_ids == reference_decode(model, TINY64, r), r.request_id
    moved = [r for r in requests if r.kv_transfer_bytes]
    assert moved and all(r.first_token_s >= r.kv_transfer_end_s >= r.kv_transfer_start_s >= r.prefill_first_token_s
                         for r in moved)  # (a client behind a proxy gets its first token once the KV is there)
    assert all(r.num_output_tokens == 1 or r.kv_transfer_bytes for r in requests)  # all that decode moved
    assert {rec.worker for rec in s.records} >= {"prefill0", "decode0"}
    if kw.get("kv_blocks"):
        assert sum(rec.preemptions for rec in s.records) > 0
    if kw.get("prefix_caching"):
        assert sum(r.cached_tokens for r in requests) > 0
    if kw.get("worker_strategy") == "overlap":  # a step of each worker was launched before the last was waited for
        for w in s.workers:
            assert w.core.depth == 2
            recs = sorted((rec for rec in s.records if rec.worker == w.label), key=lambda rec: rec.iteration)
            assert any(not rec.waited_before_next_launch for rec in recs[:-1]), w.label
        # a prefill worker computes prompts only: none of its steps decodes (under overlap a request whose last
        # chunk is in flight is left out of the next step, not decoded once more there)
        assert all(rec.num_generation_requests == 0 for rec in s.records if rec.worker.startswith("prefill"))


def test_greedy_tokens_equal_hugging_face(hf_checkpoint):
    """A checkpoint served by 1 prefill + 2 decode workers gives Hugging Face's greedy ``generate``."""
    import torch

    from strategies.runtime.models.checkpoint import config_from_hf, load_checkpoint
    from strategies.runtime.models.llama import script_model

    path, hf_model = hf_checkpoint
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    model = script_model(load_checkpoint(path, cfg))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in (7, 30, 12, 21, 40)]
    requests = make_requests([(p, 16, SamplingParams()) for p in prompts])
    run_strategy("disagg", cfg, model, _config(num_decode_workers=2), requests)
    for p, r in zip(prompts, requests, strict=True):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                pad_token_id=0)
        assert r.output_token_ids == ref[0, len(p):].tolist()
        assert r.kv_transfer_bytes or r.num_output_tokens == 1


def test_decode_side_preemption_recomputes_there_and_changes_no_token():
    """Four 20-token prompts that each grow to 60 tokens (4 blocks) on a decode worker of 6 blocks: once two
    run there, max-utilization preempts one after its KV arrived, and it resumes on the decode worker by
    recomputing prompt and outputs; tokens equal each request alone, every block comes back."""
    _, model = tiny_models()
    requests = make_requests([(list(range(3 + i, 23 + i)), 40, SamplingParams(temperature=0.8 * (i % 2), seed=i))
                              for i in range(4)])
    s = run_strategy("disagg", TINY64, model, _config(capacity_policy="max-utilization", kv_blocks=6), requests,
                     keep_open=True)
    try:
        _assert_all_returned(s)
    finally:
        s.close()
    assert sum(rec.preemptions for rec in s.records if rec.worker == "decode0") > 0
    assert all(r.output_token_ids == reference_decode(model, TINY64, r) for r in requests)


def test_the_kv_really_moves(monkeypatch):
    """Mutation: a receive that leaves the decode worker's blocks as they were changes the tokens, so the
    tests above see the transfer (and not a decode worker that somehow recomputes the prompt)."""
    _, model = tiny_models()
    monkeypatch.setattr(KVStaging, "scatter", lambda self, n, k, v: None)
    requests = make_requests([(p, max(n, 8), SamplingParams()) for p, n, _ in _specs()])
    run_strategy("disagg", TINY64, model, _config(cpu_device="thread"), requests)
    wrong = [r for r in requests if r.output_token_ids != reference_decode(model, TINY64, r)]
    assert len(wrong) >= len(requests) // 2


def test_a_dead_decode_worker_fails_its_requests_and_the_others_finish():
    """decode0's device fails at its fourth step: its requests end failed with the reason, requests on
    their way to it go to decode1, every other request finishes with its reference tokens, and the run
    then ends with the failure."""
    _, model = tiny_models()
    requests = make_requests(_specs(16))
    s = get_strategy("disagg")(TINY64, model, _config(num_decode_workers=2))
    s.inject_fault(3)
    with pytest.raises(RuntimeError, match="decode0 failed: RuntimeError: injected engine fault at iteration 3"):
        s.run(ListSource(requests))
    s.close()
    failed = [r for r in requests if r.status is Status.FAILED]
    done = [r for r in requests if r.status is Status.FINISHED]
    assert failed and len(done) > len(requests) // 2 and len(failed) + len(done) == len(requests)
    assert all(r.finish_reason.startswith("decode0 failed") for r in failed)
    assert all(r.output_token_ids == reference_decode(model, TINY64, r) for r in done)
    alive = [w for w in s.workers if w.label != "decode0"]
    assert all(w.kv.free_blocks == w.kv.total_blocks for w in alive)
    # (its device is poisoned at the step: whichever touches it first, its step's wait or a transfer's piece, finds it)
    assert [(f["worker"], f["found"] in ("step", "transfer")) for f in s.faults] == [("decode0", True)]


def test_a_worker_death_is_in_run_json_and_one_line_and_the_run_exits_1(tmp_path):
    """Through the harness: decode0 dies at its fourth step; run.json records the fault (worker, run-clock
    time, cause, how it was found), the log says it in one line, and the exit status is 1."""
    import harness.app as app
    from harness.options import RunOptions

    opts = RunOptions(model="tiny", device="cpu", strategies=("disagg",), num_prompts=12, request_rate=50.0,
                      input_len=24, output_len=12, num_decode_workers=2, warmup=0)
    lines: list[str] = []
    outcome = app.execute(opts, tmp_path / "run", progress=False, report=False, fault=("disagg", 3),
                          log=lines.append)
    assert outcome.exit_code == 1
    (entry,) = json.loads((tmp_path / "run" / "run.json").read_text())["strategies"]
    (fault,) = entry["faults"]
    assert fault["worker"] == "decode0" and fault["found"] in ("step", "transfer") and "injected" in fault["cause"]
    assert 0 < fault["time_s"] < entry["wall_s"]
    said = [x for x in lines if "decode0 died" in x]
    assert len(said) == 1 and "\n" not in said[0] and "injected" in said[0], lines


def test_a_transfer_that_fails_on_the_receiver_fails_only_that_worker(monkeypatch):
    """decode0's third receive raises on its device (thread device, so the patch reaches it): decode0 dies
    with its requests, the transfers it was receiving go to decode1, and every other request finishes
    with its reference tokens; no transfer is left half-done."""
    from strategies.runtime.engine import Engine

    _, model = tiny_models()
    receives: dict[int, int] = {}
    real = Engine.kv_recv

    def flaky(self, n, peer=None, source=None):
        receives[id(self)] = receives.get(id(self), 0) + 1
        if receives[id(self)] == 3 and self is flaky.decode0:
            raise RuntimeError("link down")
        return real(self, n, peer, source)

    monkeypatch.setattr(Engine, "kv_recv", flaky)
    requests = make_requests(_specs(16))
    s = get_strategy("disagg")(TINY64, model, _config(num_decode_workers=2, cpu_device="thread"))
    flaky.decode0 = s.decode[0].engine
    with pytest.raises(RuntimeError, match="decode0 failed: RuntimeError: link down"):
        s.run(ListSource(requests))
    s.close()
    done = [r for r in requests if r.status is Status.FINISHED]
    failed = [r for r in requests if r.status is Status.FAILED]
    assert len(done) + len(failed) == len(requests) and len(done) > len(requests) // 2
    assert all(r.finish_reason.startswith("decode0 failed") for r in failed)
    assert all(r.output_token_ids == reference_decode(model, TINY64, r) for r in done)
    assert not s.transceiver.active and not s.transceiver.queue
    assert all(w.kv.free_blocks == w.kv.total_blocks for w in s.workers if w.label != "decode0")


def test_ctrl_c_exits_130_and_leaves_no_device_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--model", "tiny", "--strategies", "disagg",
                             "--num-prompts", "2000", "--request-rate", "50", "--warmup", "0", "--out",
                             str(tmp_path / "r")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    devices = child_pids(proc, "process_server", 2)  # a device process per worker
    assert len(devices) == 2
    wait_for_progress(proc, "disagg", 5)  # serving: some requests finished (a fixed sleep was not enough in CI)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    time.sleep(0.5)
    assert not still_alive(devices), f"device processes left behind: {still_alive(devices)}"
    req = pd.read_parquet(tmp_path / "r" / "disagg" / "requests.parquet")
    assert (req["status"] == "finished").any()  # what was measured is kept


def test_simulated_transfer_costs_what_the_link_says(tmp_path):
    """Llama-3-8B on H100s (bf16: 32 layers x 8 KV heads x 128 x 2 bytes x K and V = 128 KiB a token, from
    its config.json): each transfer takes latency per 64 MiB chunk + bytes / (50 GB/s x 0.85), and never
    less than bytes / 50 GB/s; a 10x faster link shortens it, and the tokens equal inflight's."""
    args = ["--device", "sim", "--model-spec", "llama-3-8b", "--gpu", "h100", "--num-prompts", "40",
            "--request-rate", "4", "--input-len", "2000", "--output-len", "32", "--warmup", "0", "--no-progress",
            "--serving-path", "none"]
    p = cli("run", *args, "--strategies", "inflight,disagg", "--out", str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr
    req = pd.read_parquet(tmp_path / "a" / "disagg" / "requests.parquet")
    per_token = 2 * 32 * 8 * 128 * 2
    blocks = -(-req["input_tokens"] // 16)
    assert (req["kv_transfer_bytes"] == blocks * 16 * per_token).all()
    chunks = -(-req["kv_transfer_bytes"] // (64 * 2**20))
    expected_ms = (chunks * 10e-6 + req["kv_transfer_bytes"] / (50e9 * 0.85)) * 1e3
    assert np.allclose(req["kv_transfer_ms"], expected_ms, rtol=1e-6)
    assert (req["kv_transfer_ms"] >= req["kv_transfer_bytes"] / 50e9 * 1e3).all()
    tokens = {name: [json.loads(x)["tokens"] for x in (tmp_path / "a" / name / "tokens.jsonl").read_text().split()]
              for name in ("inflight", "disagg")}
    assert tokens["inflight"] == tokens["disagg"]
    p = cli("run", *args, "--strategies", "disagg", "--kv-link-gbps", "500", "--out", str(tmp_path / "b"))
    fast = pd.read_parquet(tmp_path / "b" / "disagg" / "requests.parquet")
    assert fast["kv_transfer_ms"].mean() < req["kv_transfer_ms"].mean() / 5
    row = json.loads((tmp_path / "a" / "summary.json").read_text())[1]
    assert row["mean_kv_transfer_ms"] == pytest.approx(req["kv_transfer_ms"].mean())
    queued = (req["admitted_s"] - req["arrival_s"]) * 1e3
    assert (queued >= 0).all() and row["mean_prefill_queue_ms"] == pytest.approx(queued.mean())
    waited = (req["kv_transfer_start_s"] - req["kv_ready_s"]) * 1e3
    assert (req["kv_ready_s"] >= req["admitted_s"]).all()
    assert (waited >= 0).all() and row["p99_kv_queue_ms"] == pytest.approx(np.percentile(waited, 99))
    # Two first-token times (docs/outputs.md, "Metrics"): a client behind a proxy gets the first token only once the
    # KV has landed and the decode worker has stepped (after kv_transfer_end_s); the prefill worker read it before
    # its KV left (prefill_first_token_s <= kv_transfer_start_s, --serving-path none here: engine times)
    assert (req["first_token_s"] > req["kv_transfer_end_s"]).all()
    assert (req["prefill_first_token_s"] <= req["kv_transfer_start_s"]).all()
    assert (req["prefill_ttft_ms"] < req["ttft_ms"]).all()
    assert row["median_prefill_ttft_ms"] == pytest.approx(req["prefill_ttft_ms"].median())


def test_overlap_workers_hide_the_host_time_inflight_workers_wait_for(tmp_path):
    """--worker-strategy on sim, the host's time modelled (1 ms a step): with overlap workers the decode worker's
    next step is launched while the host postprocesses the last, so the decode time a token takes (TPOT) falls
    by close to the host's share of an in-flight step; the tokens are the same."""
    args = ["--device", "sim", "--model-spec", "llama-3-8b", "--gpu", "h100", "--num-prompts", "60",
            "--request-rate", "20", "--input-len", "400", "--output-len", "64", "--warmup", "0", "--no-progress",
            "--host-time", "modelled", "--host-ms-per-iteration", "1", "--strategies", "disagg"]
    runs = {}
    for w in ("inflight", "overlap"):
        p = cli("run", *args, "--worker-strategy", w, "--out", str(tmp_path / w))
        assert p.returncode == 0, p.stderr
        runs[w] = pd.read_parquet(tmp_path / w / "disagg" / "iterations.parquet")
        runs[w + "_tokens"] = (tmp_path / w / "disagg" / "tokens.jsonl").read_text().count('"tokens"')
    summary = {w: json.loads((tmp_path / w / "summary.json").read_text())[0] for w in ("inflight", "overlap")}
    tpot = {w: summary[w]["median_tpot_ms"] for w in summary}
    decode = runs["inflight"][runs["inflight"]["worker"] == "decode0"]
    step_ms = ((decode["wait_s"] - decode["launch_s"]) * 1e3).median()  # an in-flight decode step, device time
    assert tpot["overlap"] < tpot["inflight"] - 0.5, tpot  # (most of the 1 ms: the step's own host time)
    assert tpot["overlap"] > step_ms * 0.9, (tpot, step_ms)  # never faster than the device computes
    assert runs["inflight_tokens"] == runs["overlap_tokens"] == 60
    assert runs["overlap"].loc[runs["overlap"]["worker"] == "prefill0", "num_generation_requests"].sum() == 0


def test_one_run_compares_replicas_with_disagg_at_equal_gpus(tmp_path):
    """docs/disagg.md's question in one command: --num-replicas applies to inflight, P and D to disagg, and the
    summary says what each used (2 engines, 2 GPUs each side); replicas' steps are replica0/1's, disagg's its
    workers'."""
    out = tmp_path / "eq"
    p = cli("run", "--device", "sim", "--model-spec", "tiny", "--strategies", "inflight,disagg", "--num-replicas", "2",
            "--num-prefill-workers", "1", "--num-decode-workers", "1", "--num-prompts", "30", "--request-rate", "40",
            "--warmup", "0", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    summary = pd.read_csv(out / "summary.csv").set_index("strategy")
    assert list(summary["engines"]) == [2, 2] and list(summary["gpus"]) == [2, 2]
    workers = {s: set(pd.read_parquet(out / s / "iterations.parquet")["worker"]) for s in ("inflight", "disagg")}
    assert workers == {"inflight": {"replica0", "replica1"}, "disagg": {"prefill0", "decode0"}}


def test_replicas_serve_every_request_with_the_same_tokens():
    """Two in-flight replicas behind the router: each serves some requests, the tokens are one engine's."""
    _, model = tiny_models()
    one, two = make_requests(_specs()), make_requests(_specs())
    run_strategy("inflight", TINY64, model, _config(), one)
    from strategies.fleet import replicated

    s = replicated(get_strategy("inflight"))(TINY64, model, _config(num_replicas=2))
    try:
        s.run(ListSource(two))
    finally:
        s.close()
    assert [r.output_token_ids for r in one] == [r.output_token_ids for r in two]
    assert {rec.worker for rec in s.records} == {"replica0", "replica1"}


@pytest.mark.parametrize("router", ["least-tokens", "round-robin"])
def test_routers_send_arrivals_where_they_say(router):
    """Arrivals at t = 0: round-robin alternates; least-tokens sends each to the replica with the fewest
    tokens left (one 40-token prompt, then 5-token ones: the short ones pile onto the other replica
    until it holds as much work)."""
    _, model = tiny_models()
    requests = make_requests([([5] * 40, 4, SamplingParams())] + [([5] * 5, 4, SamplingParams())] * 7)
    from strategies.fleet import replicated

    s = replicated(get_strategy("inflight"))(TINY64, model, _config(num_replicas=2, router=router))
    try:
        s.run(ListSource(requests))
    finally:
        s.close()
    first = {}
    for t in s.slot_tenures():
        first.setdefault(t.request_id, t.worker)
    got = [first[r.request_id] for r in requests]
    if router == "round-robin":
        assert got == ["replica0", "replica1"] * 4
    else:  # loads: 44 | 9, 18, 27, 36, 45 -> then 44 < 45
        assert got == ["replica0", "replica1", "replica1", "replica1", "replica1", "replica1", "replica0",
                       "replica1"]


@pytest.mark.parametrize(("args", "message"), [
    (["--strategies", "overlap", "--num-replicas", "2"], "--num-replicas: inflight runs several engines"),
    (["--strategies", "disagg", "--num-prefill-workers", "0"], "--num-prefill-workers and --num-decode-workers"),
    (["--strategies", "disagg", "--kv-link-gbps", "0"], "--kv-link-gbps must be positive"),
    (["--strategies", "disagg", "--kv-transfer-buffer-mb", "-1"], "--kv-transfer-buffer-mb must be positive"),
    (["--strategies", "inflight", "--num-replicas", "0"], "--num-replicas must be positive"),
    (["--strategies", "disagg", "--model", "tiny-bart", "--encoder-input-len", "8"], "run decoder-only models"),
    (["--strategies", "inflight", "--num-replicas", "2", "--router", "random"], "invalid choice: 'random'"),
    (["--strategies", "disagg", "--speculative-config", '{"method": "ngram"}'], "disagg does not speculate"),
    (["--strategies", "disagg", "--num-decode-workers", "2", "--devices", "cpu,cpu"],
     "--devices: disagg runs 3 engines, 2 devices given"),
    (["--strategies", "inflight", "--devices", "cpu,cpu"], "--devices: only a fleet runs several engines"),
    (["--strategies", "inflight", "--num-replicas", "2", "--devices", "cpu,cuda:0"],
     "--devices 'cuda:0': expected cpu"),
])
def test_bad_disagg_options_are_one_line_exit_2(tmp_path, args, message):
    p = cli("run", "--model", "tiny", "--num-prompts", "2", *args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_staging_holds_at_least_one_block():
    assert block_bytes(TINY64, 16) > 0.001 * 2**20  # the tests' 0.001 MiB buffer: one block a chunk


def test_capacity_search_replays_a_trace_at_each_rate_and_counts_every_gpu(tmp_path):
    """A [capacity] search over a replayed trace (bursty: pairs of requests 10 ms apart, pairs 1 s apart)
    reaches each rate by --time-scale: every evaluated run's mean arrival rate is the rate searched, and its
    arrival pattern is the trace's, scaled. Per-GPU throughput divides by every GPU of the configuration."""
    from harness.suite.run import run_suite

    lines = [{"arrival_s": (i // 2) * 1.0 + (i % 2) * 0.01, "input_tokens": 1024, "output_tokens": 32}
             for i in range(40)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "cap.toml").write_text(f"""
name = "cap"
[defaults]
device = "sim"
gpu = "h100"
model_spec = "llama-3-8b"
trace = "{tmp_path / 't.jsonl'}"
ignore_eos = true
host_time = "modelled"
max_seq_len = 2048
warmup = 0
[capacity]
goodput = ["ttft:400", "tpot:40"]
rate_lo = 0.5
rate_hi = 2048.0  # past the two replicas' edge on these 40 requests (256-512 req/s)
tolerance = 0.5
[[runs]]
name = "two"
strategies = ["inflight"]
num_replicas = 2
[[runs]]
name = "pd"
strategies = ["disagg"]
""")
    code, out, _ = run_suite(tmp_path / "cap.toml", tmp_path / "out", progress=False)
    assert code == 0
    points = pd.read_csv(out / "capacity_points.csv")
    natural = 39 / 19.01  # 40 arrivals over 19.01 s
    for p in points.itertuples():
        req = pd.read_parquet(out / f"{p.config}@rate={p.request_rate:.8g}" / p.config.split(".")[1]
                              / "requests.parquet").sort_values("arrival_s")
        arrivals = req["arrival_s"].to_numpy()
        assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(p.request_rate, rel=1e-6)
        assert arrivals[1] - arrivals[0] == pytest.approx(0.01 * natural / p.request_rate, rel=1e-6)
    table = pd.read_csv(out / "capacity.csv").set_index("config")
    assert (table["gpus"] == 2).all() and (table["status"] == "bracketed").all()
    assert table.loc["pd", "output_tok_s_per_gpu"] == pytest.approx(table.loc["pd", "output_throughput"] / 2)


def test_records_timeline_and_report_show_each_engine(tmp_path):
    """A disagg run's files: iterations and slot tenures name their engine, the Perfetto timeline has a
    device lane per engine, and the report's slot occupancy has a panel per engine (the slots of two
    engines are different slots)."""
    out = tmp_path / "r"
    p = cli("run", "--model", "tiny", "--strategies", "disagg", "--num-prompts", "8", "--warmup", "0",
            "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    it = pd.read_parquet(out / "disagg" / "iterations.parquet")
    slots = pd.read_parquet(out / "disagg" / "slots.parquet")
    assert set(it["worker"]) == set(slots["worker"]) == {"prefill0", "decode0"}
    assert set(slots.loc[slots["worker"] == "prefill0", "end"]) <= {"handed off", "finished"}
    lanes = {e["args"]["name"] for e in json.loads((out / "disagg" / "timeline.json").read_text())["traceEvents"]
             if e["ph"] == "M"}
    assert {"device prefill0", "device decode0"} <= lanes
    html = (out / "report.html").read_text()
    assert "disagg prefill0" in html and "disagg decode0" in html


def test_devices_are_checked_against_the_machines_gpus(monkeypatch):
    """--devices names a GPU per engine: refused in one line where the machine has fewer (a one-GPU machine,
    stood in for by torch.cuda's answers), accepted where it has them; each engine's config then names its own
    device, disagg's prefill workers first."""
    import torch

    from harness.errors import UserError
    from harness.options import RunOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = {"device": "cuda", "strategies": ("inflight", "disagg"), "num_replicas": 2, "devices": "cuda:0,cuda:1"}
    with pytest.raises(UserError, match=r"--devices names cuda:1: this machine has 1 GPU$"):
        RunOptions(**args)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = RunOptions(**args).executor_config(256)
    assert cfg.devices == ("cuda:0", "cuda:1")
    assert [cfg.on(i).device for i in range(2)] == ["cuda:0", "cuda:1"] and cfg.on(1).devices is None


def test_a_fleet_builds_each_engine_on_its_device(monkeypatch):
    """Replicas and disagg's workers take their device from --devices in order — the replicas in turn; disagg's
    prefill workers, then its decode workers — seen by recording the config each engine is built with."""
    import strategies.disagg.executor as disagg
    import strategies.fleet as fleet

    built = []

    class Engine:  # stands in for the in-flight strategy a worker is: records its config, builds nothing
        def __init__(self, model_cfg, model, config, clock, role):
            from types import SimpleNamespace

            built.append((role.label, config.device, config.devices))
            self.label, self.role, self.config = role.label, role, config
            self.stream = self.slots = None
            staging = SimpleNamespace(memory=SimpleNamespace(share=lambda host: None), host=None)
            self.engine = SimpleNamespace(kv_staging=staging)

        def close(self):
            pass

    monkeypatch.setattr(disagg, "InflightStrategy", Engine)
    monkeypatch.setattr(fleet, "InflightStrategy", Engine)
    devices = ("cuda:0", "cuda:1", "cuda:2")
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=32, devices=devices,
                         disagg=DisaggConfig(num_prefill_workers=1, num_decode_workers=2))
    disagg.DisaggStrategy(TINY64, None, cfg)
    assert built == [("prefill0", "cuda:0", None), ("decode0", "cuda:1", None), ("decode1", "cuda:2", None)]
    built.clear()
    fleet.Replicas(TINY64, None, replace(cfg, num_replicas=2, devices=devices[:2]))
    assert built == [("replica0", "cuda:0", None), ("replica1", "cuda:1", None)]


def test_a_decode_worker_killed_while_idle_leaves_the_others_serving():
    """The scenario of the issue on faults, scaled down: 1 prefill + 2 decode workers, each a device process of
    its own; two bursts of 8 requests; decode1's process killed (SIGKILL) once the first is done, while it is
    idle, and the second arrives 0.5 s later (after the kill, whatever the machine's speed). The fleet's health
    check between steps sees the death before it routes again (not when work is next routed to the dead worker):
    the fault is recorded (worker, time, cause, how found), decode0 serves every request of both bursts and
    decode1 computes nothing more; the run then ends with the failure (exit 1 from the CLI), as it does when a
    death is found at a step."""
    import signal

    _, model = tiny_models()
    specs = _specs(n=8)
    s = get_strategy("disagg")(TINY64, model, _config(num_decode_workers=2))
    start = s.clock.now()  # (the run clock started as the engines did: their device processes took a while)
    first = make_requests(specs)
    for r in first:
        r.arrival_s = start
    second = [Request(f"late{i}", r.prompt_token_ids.copy(), r.max_new_tokens, r.sampling, arrival_s=start + 30)
              for i, r in enumerate(make_requests(specs))]  # (set to the kill's time + 0.5 s at the kill)
    victim = s.decode[1].stream._server.proc
    killed = []

    class KillInTheGap(ListSource):
        def poll(self, now_s: float) -> list:
            if not killed and all(r.status.terminal for r in first):  # the first burst done: decode1 is idle
                assert not s.decode[1].running and not s.decode[1].role.receiving
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                killed.append(now_s)
                for r in second:
                    r.arrival_s = now_s + 0.5
            return super().poll(now_s)

    try:
        with pytest.raises(RuntimeError, match="decode1 failed"):
            s.run(KillInTheGap(first + second))
    finally:
        s.close()
    assert killed
    assert all(r.status is Status.FINISHED for r in first + second), [r.finish_reason for r in first + second
                                                                      if r.status is not Status.FINISHED]
    assert [w.label for w in s.alive] == ["prefill0", "decode0"]
    (fault,) = s.faults
    assert fault["worker"] == "decode1" and fault["found"] == "health check" and "exited" in fault["cause"]
    assert killed[0] <= fault["time_s"] <= min(r.admitted_s for r in second)  # seen before the next routing
    assert s.extras() == {"faults": [fault]}
    assert not [rec for rec in s.records if rec.worker == "decode1" and rec.schedule_start_s > killed[0]]


def test_the_fleets_clock_never_passes_a_step_in_flight():
    """The fleet's loop on the simulated device with overlap workers and transfers pending (a 1 GB/s link, 2,000-token
    prompts, two decode workers): every time the virtual clock is moved on, it stops at or before the end of every
    step still in flight — a worker that launched a step and may launch the next schedules it first (it once slept
    to the next transfer's end past such a step, up to 440 ms late)."""
    from harness.runner import build_requests
    from harness.traces.trace import TraceRequest
    from strategies.config import SimConfig
    from strategies.runtime.sim.engine import proxy_config
    from strategies.runtime.sim.specs import MODEL_SPECS

    cfg = ExecutorConfig(device="sim", sim=SimConfig(gpu="h100", model_spec="llama-3-8b", host_time="modelled",
                                                     host_ms_per_iteration=1.0),
                         max_batch_size=16, max_seq_len=4096, max_num_tokens=2048,
                         disagg=DisaggConfig(1, 2, kv_link_gbps=1.0, worker_strategy="overlap"))
    mcfg = proxy_config(MODEL_SPECS["llama-3-8b"])
    reqs = build_requests([TraceRequest(i * 0.05, 2000, 32) for i in range(24)], SamplingParams(ignore_eos=True),
                          mcfg.vocab_size, 0)
    s = get_strategy("disagg")(mcfg, None, cfg)
    real, late = s.clock.sleep_until, []

    def checked(t: float) -> None:
        ends = [max(e for _, e in step.work.times.values()) for w in s.alive for step in w.core.queue]
        if ends and t > min(ends) + 1e-9:
            late.append(t - min(ends))
        real(t)

    s.clock.sleep_until = checked
    try:
        s.run(ListSource(reqs))
    finally:
        s.close()
    assert all(r.status is Status.FINISHED for r in reqs)
    assert not late, f"{len(late)} moves past a step in flight, up to {max(late) * 1e3:.1f} ms"


@pytest.mark.parametrize("fault_at", [3, 6, 9])
def test_an_overlap_worker_that_dies_fails_the_requests_it_released_early(fault_at):
    """An overlap decode worker gives a request's slot back once its last token is launched, before that token is
    read: when the worker dies then, the request is still its own (in its step in flight) and fails with it,
    told to the source once — not left running with nobody to end it."""
    from harness.runner import build_requests
    from harness.traces.trace import TraceRequest
    from strategies.config import SimConfig
    from strategies.runtime.sim.engine import proxy_config
    from strategies.runtime.sim.specs import MODEL_SPECS

    cfg = ExecutorConfig(device="sim", sim=SimConfig(gpu="h100", model_spec="llama-3-8b", host_time="modelled",
                                                     host_ms_per_iteration=0.5),  # (the same schedule every run)
                         max_batch_size=16, max_seq_len=512, max_num_tokens=2048,
                         disagg=DisaggConfig(1, 2, worker_strategy="overlap"))
    mcfg = proxy_config(MODEL_SPECS["llama-3-8b"])
    reqs = build_requests([TraceRequest(i * 0.002, 64, 3) for i in range(24)], SamplingParams(ignore_eos=True),
                          mcfg.vocab_size, 0)
    s = get_strategy("disagg")(mcfg, None, cfg)
    s.inject_fault(fault_at)
    source = ListSource(reqs)
    try:
        with pytest.raises(RuntimeError, match="decode0 failed"):
            s.run(source)
    finally:
        s.close()
    assert all(r.status.terminal for r in reqs), [r.request_id for r in reqs if not r.status.terminal]
    assert sorted(r.request_id for r in source.ended) == sorted(r.request_id for r in reqs)  # each told once
    assert any(r.status is Status.FAILED for r in reqs)
