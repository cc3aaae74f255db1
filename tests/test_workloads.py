"""Workloads users replay: request-rate ramps (vllm bench serve's), time slices (AIPerf's), and vLLM's
result format, written and read."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from harness.traces.synthetic import synthetic_trace
from reports.load import load_runs
from tests.util import cli

SIM = ["--device", "sim", "--model-spec", "llama-3-8b", "--warmup", "0", "--no-progress"]


@pytest.mark.parametrize(("strategy", "rate"), [("linear", lambda p: 2 + 48 * p),
                                                ("exponential", lambda p: 2 * 25.0 ** p)])
def test_a_ramp_spaces_arrivals_at_the_rate_it_has_reached(strategy, rate):
    """20,000 arrivals on a ramp from 2 to 50 req/s: the run spans sum(1 / rate(i / (n - 1))) over the
    gaps (the law of large numbers: within 2%), and the last tenth arrives at the end's pace."""
    n = 20_000
    t = np.array([r.arrival_s for r in synthetic_trace(n, 8, 8, ramp=(strategy, 2.0, 50.0), seed=3).requests])
    expected_gaps = 1.0 / rate(np.arange(1, n) / (n - 1))
    assert t[0] == 0 and (np.diff(t) >= 0).all()
    assert t[-1] == pytest.approx(expected_gaps.sum(), rel=0.02)
    assert np.diff(t)[-n // 10:].mean() == pytest.approx(expected_gaps[-n // 10:].mean(), rel=0.05)


@pytest.mark.parametrize(("args", "message"), [
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "10", "--ramp-up-end-rps", "5"], "need 0 <= start <= end"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "a ramp needs --ramp-up-strategy"),
    (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "5"], "must be positive"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "5", "--request-rate", "3"],
     "leave --request-rate out"),
    (["--ramp-up-strategy", "cubic"], "invalid choice"),
    (["--slice-duration", "0"], "--slice-duration must be positive"),
])
def test_bad_ramp_or_slice_is_one_line_exit_2(tmp_path, args, message):
    p = cli("run", *SIM, "--num-prompts", "5", *args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ramp") / "r"
    p = cli("run", *SIM, "--strategies", "static,inflight", "--num-prompts", "300", "--input-len", "256",
            "--output-len", "64", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "2", "--ramp-up-end-rps",
            "30", "--slice-duration", "2", "--max-seq-len", "300", "--out", str(out))
    assert p.returncode == 0, p.stderr
    return out


def test_slices_add_up_to_the_run(ramp_run):
    """Each window's counts add up to the run's; the requests in flight obey Little's law (the mean number
    in flight over the run is the total time requests spent in it over the run's span)."""
    for strategy in ("static", "inflight"):
        d = ramp_run / strategy
        s, req = pd.read_csv(d / "slices.csv"), pd.read_parquet(d / "requests.parquet")
        tokens = [json.loads(x)["times_s"] for x in (d / "tokens.jsonl").read_text().splitlines()]
        assert (req["status"] == "rejected").sum() > 0  # prompts over --max-seq-len: ended at arrival
        assert s["output_tokens"].sum() == sum(len(t) for t in tokens)
        assert s["completed"].sum() == (req["status"] == "finished").sum()
        assert len(s) == int(np.ceil(req["finish_s"].max() / 2)) and (np.diff(s["start_s"]) == 2).all()
        # Little's law over the run: the windows' mean requests in flight times their length is the requests' total
        # time in flight — a finished request's arrival to finish, a failed one's to its failure, a rejected one's 0
        status = req["status"]
        in_flight = ((req["finish_s"] - req["arrival_s"])[status == "finished"].sum()
                     + (req["failed_s"] - req["arrival_s"])[status == "failed"].sum())
        assert (s["requests_in_flight"] * 2).sum() == pytest.approx(in_flight, rel=1e-9)
        # each window's latencies are those of the requests that finished in it ([start, end); the last one
        # closed), by hand from the requests file
        done = req[status == "finished"]
        checked = 0
        for _, w in s.iterrows():
            last = w["slice"] == len(s) - 1
            inw = done[(done["finish_s"] >= w["start_s"]) & ((done["finish_s"] < w["end_s"]) | last)]
            assert w["completed"] == len(inw)
            if len(inw) == 0:
                assert np.isnan(w["mean_ttft_ms"])
                continue
            e2el = (inw["finish_s"] - inw["arrival_s"]) * 1e3
            assert w["mean_ttft_ms"] == pytest.approx(((inw["first_token_s"] - inw["arrival_s"]) * 1e3).mean())
            assert w["p90_e2el_ms"] == pytest.approx(np.percentile(e2el, 90))
            checked += 1
        assert checked >= 3
        late = s.iloc[len(s) // 2:]  # the ramp: the second half's windows serve more than the first's
        assert late["request_throughput"].mean() > 2 * s.iloc[:len(s) // 2]["request_throughput"].mean()


def test_vllm_result_file_holds_the_run_in_vllms_keys_and_units(ramp_run):
    summary = pd.read_csv(ramp_run / "summary.csv").set_index("strategy")
    for strategy in ("static", "inflight"):
        res = json.loads((ramp_run / strategy / "vllm_bench.json").read_text())
        req = pd.read_parquet(ramp_run / strategy / "requests.parquet")
        row = summary.loc[strategy]
        assert res["completed"] + res["failed"] == res["num_prompts"] == len(req)
        assert res["ramp_up_strategy"] == "linear" and res["ramp_up_end_rps"] == 30
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "median_ttft_ms",
                    "p99_tpot_ms", "mean_itl_ms"):
            assert res[key] == pytest.approx(row[key], rel=1e-12), key
        ok = [not e for e in res["errors"]]
        # vLLM's units, recomputed from its own per-request lists: seconds per request, ms in aggregates
        ttfts = np.array(res["ttfts"])[ok] * 1e3
        assert res["median_ttft_ms"] == pytest.approx(np.median(ttfts), rel=1e-9)
        itls = np.concatenate([np.array(x) for x, good in zip(res["itls"], ok, strict=True) if good]) * 1e3
        assert res["mean_itl_ms"] == pytest.approx(itls.mean(), rel=1e-9)
        assert sum(res["output_lens"]) == res["total_output_tokens"]
        assert all(len(x) + 1 == n for x, n, good in zip(res["itls"], res["output_lens"], ok, strict=True) if good)
        # the aggregates as vLLM's calculate_metrics makes them from these lists (vllm/benchmarks/serve.py):
        # totals over the successful requests, per second of ``duration``; TPOT over requests of > 1 token
        dur, lat = res["duration"], np.array(res["latencies"])[ok]
        n_in = np.array(res["input_lens"])[ok].sum()
        n_out = np.array(res["output_lens"])[ok]
        assert res["total_input_tokens"] == n_in and res["total_output_tokens"] == n_out.sum()
        assert res["request_throughput"] == pytest.approx(sum(ok) / dur, rel=1e-12)
        assert res["output_throughput"] == pytest.approx(n_out.sum() / dur, rel=1e-12)
        assert res["total_token_throughput"] == pytest.approx((n_in + n_out.sum()) / dur, rel=1e-12)
        tpot = ((lat - ttfts / 1e3) / (n_out - 1))[n_out > 1] * 1e3
        assert res["p99_tpot_ms"] == pytest.approx(np.percentile(tpot, 99), rel=1e-9)
        assert res["mean_e2el_ms"] == pytest.approx(lat.mean() * 1e3, rel=1e-9)


def _vllm_file(path):
    """A result file as `vllm bench serve --save-result --save-detailed` writes it (the keys of
    vllm/benchmarks/serve.py's result dict), for three requests, one of them failed, with every aggregate
    computed here from the per-request lists."""
    ttfts, latencies = [0.120, 0.080, 0.0], [0.520, 0.380, 0.0]
    itls = [[0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1], []]
    out_lens, in_lens = [5, 4, 0], [100, 200, 300]
    ok_ttft, ok_itl = np.array(ttfts[:2]) * 1e3, np.concatenate(itls[:2]) * 1e3
    tpot = [(latencies[i] - ttfts[i]) / (out_lens[i] - 1) * 1e3 for i in range(2)]
    duration = 0.9
    data = {"date": "20250101-000000", "endpoint_type": "openai", "backend": "vllm", "label": None,
            "model_id": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct",
            "num_prompts": 3, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
            "duration": duration, "completed": 2, "failed": 1, "total_input_tokens": 300, "total_output_tokens": 9,
            "request_throughput": 2 / duration, "request_goodput": None, "output_throughput": 9 / duration,
            "total_token_throughput": 309 / duration, "input_lens": in_lens, "output_lens": out_lens,
            "ttfts": ttfts, "itls": itls, "latencies": latencies, "start_times": [1000.0, 1000.4, 1000.5],
            "generated_texts": ["a b c d e", "f g h i", ""], "errors": ["", "", "ClientError: timeout"],
            "max_output_tokens_per_s": 9.0, "max_concurrent_requests": 2,
            "mean_ttft_ms": float(ok_ttft.mean()), "median_ttft_ms": float(np.median(ok_ttft)),
            "std_ttft_ms": float(ok_ttft.std()), "p99_ttft_ms": float(np.percentile(ok_ttft, 99)),
            "mean_tpot_ms": float(np.mean(tpot)), "median_tpot_ms": float(np.median(tpot)),
            "std_tpot_ms": float(np.std(tpot)), "p99_tpot_ms": float(np.percentile(tpot, 99)),
            "mean_itl_ms": float(ok_itl.mean()), "median_itl_ms": float(np.median(ok_itl)),
            "std_itl_ms": float(ok_itl.std()), "p99_itl_ms": float(np.percentile(ok_itl, 99)),
            "mean_e2el_ms": 450.0, "median_e2el_ms": 450.0, "std_e2el_ms": 70.0, "p99_e2el_ms": 518.6}
    path.write_text(json.dumps(data))
    return data


def test_report_reads_a_vllm_result_file_beside_slotbench_runs(ramp_run, tmp_path, chromium):
    data = _vllm_file(tmp_path / "vllm-server.json")
    run = load_runs([tmp_path / "vllm-server.json"])[0]
    row = run.summary.iloc[0]
    assert row["strategy"] == "vllm" and row["completed"] == 2 and row["failed"] == 1
    assert row["median_ttft_ms"] == data["median_ttft_ms"] and row["duration_s"] == 0.9
    req = run.requests["vllm"]
    assert list(req["status"]) == ["finished", "finished", "failed"]
    assert req["arrival_s"].tolist() == pytest.approx([0.0, 0.4, 0.5])
    assert req["ttft_ms"].iloc[:2].tolist() == pytest.approx([120.0, 80.0])
    assert req["tpot_ms"].iloc[:2].tolist() == pytest.approx([100.0, 100.0])  # (520 - 120) / 4, (380 - 80) / 3
    assert len(run.token_times["vllm"]) == 9 and run.itl_ms["vllm"] == pytest.approx([100.0] * 7)
    p = cli("report", str(ramp_run), str(tmp_path / "vllm-server.json"), "--out", str(tmp_path / "both.html"))
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "both.html").read_text()
    assert "vllm-server" in html and "Llama-3.1-8B-Instruct" in html
    (tmp_path / "bad.json").write_text('{"hello": 1}')
    p = cli("report", str(tmp_path / "bad.json"), "--out", str(tmp_path / "bad.html"))
    assert p.returncode == 2 and "not a `vllm bench serve --save-result` file" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_slotbench_reads_back_what_it_wrote_for_vllm(ramp_run):
    summary = pd.read_csv(ramp_run / "summary.csv").set_index("strategy")
    run = load_runs([ramp_run / "inflight" / "vllm_bench.json"])[0]
    row = run.summary.iloc[0]
    for key in ("completed", "output_throughput", "median_ttft_ms", "p99_itl_ms"):
        assert row[key] == pytest.approx(summary.loc["inflight", key], rel=1e-9), key
    req = pd.read_parquet(ramp_run / "inflight" / "requests.parquet")
    done = req[req["status"] == "finished"]
    back = run.requests["inflight"]
    assert back.loc[back["status"] == "finished", "e2el_ms"].to_numpy() == pytest.approx(done["e2el_ms"].to_numpy())


def test_over_time_figure_draws_each_slice(ramp_run):
    """With --slice-duration the over-time figure gains two panels drawn from slices.csv: each strategy's
    median TTFT and requests in flight, one point per window at its middle."""
    from reports.figures import over_time

    fig = over_time(load_runs([ramp_run]))
    titles = [a.text for a in fig.layout.annotations]
    for title, column in [("Median TTFT per time slice (ms, requests ending in it)", "p50_ttft_ms"),
                          ("Requests in flight per time slice (mean)", "requests_in_flight")]:
        axis = f"y{titles.index(title) + 1}"
        drawn = {t.name: t for t in fig.data if t.yaxis == axis}
        assert set(drawn) == {"static", "inflight"}
        for strategy, trace in drawn.items():
            s = pd.read_csv(ramp_run / strategy / "slices.csv")
            np.testing.assert_array_equal(np.asarray(trace.y, float), s[column].to_numpy(float))
            np.testing.assert_array_equal(np.asarray(trace.x, float), s["start_s"] + 1.0)


def test_a_failed_request_is_in_flight_until_its_failure(tmp_path):
    """An engine fault at step 35 of 48 requests all sent at t = 0, 16 at a time: the first 16 finish, the rest
    fail then. They
    were in flight from their arrival to the failure (failed_s), not zero time; the windows' requests in
    flight add up to that (Little's law from the records), and their tokens, like the summary's throughput,
    count finished requests only."""
    out = tmp_path / "f"
    r = cli("run", *SIM, "--strategies", "inflight", "--num-prompts", "48", "--input-len", "32", "--output-len",
            "20", "--range-ratio", "0", "--ignore-eos", "--max-batch-size", "16", "--slice-duration", "0.05",
            "--out", str(out), env={"SLOTBENCH_INJECT_FAULT": "inflight:35"})
    assert r.returncode == 1, r.stderr
    req = pd.read_parquet(out / "inflight" / "requests.parquet")
    failed = req[req["status"] == "failed"]
    assert len(failed) == 32 and (failed["failed_s"] > failed["arrival_s"]).all()
    s = pd.read_csv(out / "inflight" / "slices.csv")
    ended = req["finish_s"].where(req["status"] == "finished", req["failed_s"])
    assert (s["requests_in_flight"] * 0.05).sum() == pytest.approx((ended - req["arrival_s"]).sum(), rel=1e-9)
    finished_tokens = req.loc[req["status"] == "finished", "output_tokens"].sum()
    assert s["output_tokens"].sum() == finished_tokens
    summary = json.loads((out / "summary.json").read_text())[0]
    assert summary["output_throughput"] == pytest.approx(finished_tokens / summary["duration_s"], rel=1e-9)


def test_vllm_result_peaks_follow_vllms_per_second_buckets():
    """``max_output_tokens_per_s`` and ``max_concurrent_requests`` as vllm/benchmarks/serve.py computes them,
    worked by hand. t0 = 0.25 (the first finished request's start); buckets of one second from there.
    A: 0.25 → 1.0, chunks at 0.5, 0.75 (three tokens handed out together: one chunk), 1.0 — all in bucket 0.
    B: 1.125 → 1.75, chunks at 1.5 and 1.75: bucket 1. C failed: not counted.
    Tokens: bucket 0 has 3 chunk times (not 5 tokens). Requests: A is active in bucket 0, B in buckets 0 and 1,
    so bucket 0 counts 2, though A ends before B starts (the instantaneous peak, what was written before, is 1)."""
    from harness.output.vllm_bench import vllm_result
    from reports.token_times import TokenTimes

    requests = pd.DataFrame({"request_id": ["a", "b", "c"], "status": ["finished", "finished", "failed"],
                             "arrival_s": [0.25, 1.125, 0.0], "first_token_s": [0.5, 1.5, np.nan],
                             "finish_s": [1.0, 1.75, np.nan], "input_tokens": [8, 8, 8], "output_tokens": [5, 2, 0],
                             "finish_reason": ["length", "length", "engine fault"]})
    times = TokenTimes.of({"a": [0.5, 0.75, 0.75, 0.75, 1.0], "b": [1.5, 1.75]}, ["a", "b", "c"])
    row = {"duration_s": 1.75, "total_input_tokens": 16, "total_output_tokens": 7, "request_throughput": 1.0,
           "output_throughput": 4.0, "total_token_throughput": 13.0}
    res = vllm_result("inflight", "tiny", requests, times, row, {})
    assert res["max_output_tokens_per_s"] == 3.0
    assert res["max_concurrent_requests"] == 2
    assert res["itls"][0] == pytest.approx([0.25, 0.25])  # one gap per chunk, as vLLM records them
