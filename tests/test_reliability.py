"""Invariants over random traces, determinism, and what happens to run directories under failure."""

import dataclasses
import math
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.metrics import request_metrics
from harness.output.records import requests_frame
from harness.runner import build_requests, run_strategy
from harness.traces.trace import TraceRequest
from reports.token_times import TokenTimes
from strategies.config import ExecutorConfig
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, cli, tiny_models, wait_for_progress

STRATEGIES = ("static", "inflight", "overlap")
TIMING_FIELDS = {f.name for f in dataclasses.fields(IterationRecord) if f.name.endswith("_s")}

trace_st = st.lists(st.tuples(st.integers(1, 80), st.integers(1, 40)), min_size=1, max_size=25)


def make_trace(rows, arrivals=None):
    return [TraceRequest(0.0 if arrivals is None else arrivals[i], n_in, n_out) for i, (n_in, n_out) in enumerate(rows)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=trace_st, max_batch=st.integers(1, 8), policy=st.sampled_from(["guaranteed-no-evict", "max-utilization"]),
       kv_blocks=st.integers(4, 40), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_every_request_ends_once_and_runs_are_deterministic(rows, max_batch, policy, kv_blocks, temperature, seed):
    _, scripted = tiny_models()
    cfg = ExecutorConfig(max_batch_size=max_batch, max_seq_len=96, max_num_tokens=64, tokens_per_block=8,
                         kv_blocks=kv_blocks, capacity_policy=policy, chunked_prefill=True)
    sampling = SamplingParams(temperature=temperature)
    for name in STRATEGIES:
        runs = []
        for _ in range(2):
            reqs = build_requests(make_trace(rows), sampling, TINY64.vocab_size, seed)
            ended = []
            run = run_strategy(name, TINY64, scripted, cfg, reqs, on_end=ended.append)
            assert run.error is None
            # exactly one terminal status each, reported exactly once
            assert sorted(r.request_id for r in ended) == sorted(r.request_id for r in reqs)
            assert all(r.status.terminal and r.finish_reason for r in reqs)
            frame = requests_frame(reqs)
            summary = request_metrics(frame, TokenTimes.of({r.request_id: r.token_times_s for r in reqs},
                                                           frame["request_id"]))
            assert summary["completed"] + summary["rejected"] + summary["failed"] == len(rows)
            runs.append(run)
        a, b = runs
        assert [r.output_token_ids for r in a.requests] == [r.output_token_ids for r in b.requests]
        assert [r.status for r in a.requests] == [r.status for r in b.requests]
        def untimed(run):
            return [{k: v for k, v in rec.to_dict().items() if k not in TIMING_FIELDS and k != "wait_s"}
                    for rec in run.records]

        assert untimed(a) == untimed(b)


def test_tokens_do_not_depend_on_arrival_timing():
    """Timed arrivals change batching, never tokens (counter-based sampling)."""
    _, scripted = tiny_models()
    rows = [(10 + i % 13, 6 + i % 5) for i in range(20)]
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64)
    out = {}
    for label, arrivals in (("offline", None), ("timed", [i * 0.003 for i in range(20)])):
        reqs = build_requests(make_trace(rows, arrivals), SamplingParams(temperature=0.9, top_p=0.8),
                              TINY64.vocab_size, seed=7)
        run_strategy("inflight", TINY64, scripted, cfg, reqs)
        out[label] = [r.output_token_ids for r in reqs]
    assert out["offline"] == out["timed"]


TINY = ["--model", "tiny", "--input-len", "16", "--output-len", "8", "--max-seq-len", "64", "--warmup", "0",
        "--no-progress"]


def test_force_replaces_whole_directory_and_failures_leave_it_intact(tmp_path):
    out = tmp_path / "run"
    assert cli("run", *TINY, "--num-prompts", "5", "--out", str(out)).returncode == 0
    (out / "marker").write_text("old")
    bad = cli("run", *TINY, "--num-prompts", "5", "--out", str(out), "--force", "--trace", str(tmp_path / "none.csv"))
    assert bad.returncode == 2 and (out / "marker").read_text() == "old"  # bad input: nothing touched
    ok = cli("run", *TINY, "--num-prompts", "7", "--out", str(out), "--force")
    assert ok.returncode == 0 and not (out / "marker").exists()  # replaced whole, never merged
    assert len(pd.read_parquet(out / "inflight" / "requests.parquet")) == 7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_second_sigint_exits_at_once(tmp_path):
    args = [sys.executable, "-m", "harness.cli", "run", "--model", "tiny", "--num-prompts", "20000",
            "--request-rate", "200", "--max-seq-len", "64", "--input-len", "16", "--output-len", "8", "--warmup", "0",
            "--out", str(tmp_path / "r")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_progress(proc, "static", 20)  # the first strategy: later ones start after 20,000 requests
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # the second Ctrl-C lands while the first one's cleanup runs
    proc.send_signal(signal.SIGINT)
    t = time.perf_counter()
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.perf_counter() - t < 10


def test_nan_free_summary_json_is_strict(tmp_path):
    out = tmp_path / "r"
    assert cli("run", *TINY, "--num-prompts", "3", "--output-len", "1", "--range-ratio", "0", "--ignore-eos",
               "--out", str(out)).returncode == 0
    import json

    rows = json.loads((out / "summary.json").read_text())  # strict JSON: NaN became null
    assert rows[0]["mean_tpot_ms"] is None
    assert math.isnan(pd.read_csv(out / "summary.csv")["mean_tpot_ms"][0])


@pytest.mark.parametrize("field", ["max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block"])
def test_non_positive_limits_are_refused(field):
    with pytest.raises(ValueError, match="must be positive"):
        ExecutorConfig(**{field: 0})


@pytest.mark.parametrize("strategy", ["static", "inflight", "overlap"])
def test_max_concurrency_is_a_closed_loop(strategy):
    """--max-concurrency 3 at an infinite rate: never more than 3 requests between sent and finished
    (counted from the requests' own times), always 3 while some wait, and each later request is sent at
    the moment an earlier one finished (vllm bench serve's semaphore)."""
    _, scripted = tiny_models()
    trace = [TraceRequest(0.0, 6 + i % 5, 4 + i % 3) for i in range(12)]
    reqs = build_requests(trace, SamplingParams(ignore_eos=True), TINY64.vocab_size, seed=1)
    run = run_strategy(strategy, TINY64, scripted, ExecutorConfig(max_batch_size=8, max_seq_len=64), reqs,
                       max_concurrency=3)
    assert run.error is None and all(r.num_output_tokens == r.max_new_tokens for r in reqs)
    sent = sorted(r.arrival_s for r in reqs)
    finished = sorted(r.finish_s for r in reqs)
    assert sent[:3] == [0.0, 0.0, 0.0]
    for t in sent:  # in flight just after each send
        assert sum(1 for r in reqs if r.arrival_s <= t < r.finish_s) <= 3
    # the k-th request sent (k >= 3) left the client when the (k-3)-th finish happened: one in, one out
    assert sent[3:] == pytest.approx(finished[:len(sent) - 3], abs=0)


@pytest.mark.parametrize("fault", [None, ("inflight", 3)])
def test_a_run_keeps_the_collector_off_what_existed_before_it_only_while_it_runs(tmp_path, monkeypatch, fault):
    """execute() freezes the heap (gc.freeze) for the run and gives it back on the way out, also when a
    strategy fails: an object made before the run is out of the collector's generations while the strategy
    runs, and back in them afterwards, nothing left frozen. Automatic collection pauses while each strategy's
    files and the report are written, and only then."""
    import gc

    import harness.app as app
    import harness.measure as measure
    from harness.options import RunOptions

    before = [object()]  # a container the collector tracks, made before the run
    seen: list[bool] = []
    collecting: list[bool] = []  # while each strategy's files are written
    real, real_write = measure.run_strategy, measure.write_strategy

    def spy(*args, **kwargs):
        seen.append(any(o is before for o in gc.get_objects()))
        return real(*args, **kwargs)

    def write_spy(*args, **kwargs):
        collecting.append(gc.isenabled())
        return real_write(*args, **kwargs)

    def report_spy(*args, **kwargs):
        collecting.append(gc.isenabled())

    monkeypatch.setattr(measure, "run_strategy", spy)
    monkeypatch.setattr(measure, "write_strategy", write_spy)
    monkeypatch.setattr("reports.html.write_report", report_spy)
    opts = RunOptions(device="sim", model_spec="llama-3-8b", num_prompts=8, strategies=("inflight", "static"))
    outcome = app.execute(opts, tmp_path / "run", progress=False, report=True, fault=fault, log=lambda _: None)
    assert outcome.exit_code == (1 if fault else 0)
    assert seen == [False, False]  # each strategy, the one after a failed one too
    assert gc.get_freeze_count() == 0 and any(o is before for o in gc.get_objects())
    assert collecting == [False, False, False] and gc.isenabled()  # paused for the writing only
