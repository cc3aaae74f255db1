"""``slotbench compare``: measured files read as their formats define them, and predicted figures computed
by hand from a run's requests."""

import json

import numpy as np
import pandas as pd
import pytest

from harness.compare.measured import read_measured
from harness.compare.table import compare, predicted_figures
from tests.util import cli


def _requests(ttft_ms, e2el_ms, stage, out_tokens=11, status=None):
    n = len(ttft_ms)
    return pd.DataFrame({"arrival_s": np.arange(n, dtype=float), "stage": stage, "ttft_ms": ttft_ms,
                         "e2el_ms": e2el_ms, "output_tokens": out_tokens,
                         "status": status or ["finished"] * n})


def test_predicted_figures_by_hand():
    reqs = _requests([10.0, 20.0, 30.0, 40.0], [110.0, 120.0, 130.0, 240.0], [0, 0, 1, 1],
                     status=["finished", "finished", "finished", "failed"])
    stages = [{"start_s": 0.0, "end_s": 2.0}, {"start_s": 2.0, "end_s": 6.0}]
    f = predicted_figures(reqs, stages).set_index(["stage", "metric", "stat"])["value"]
    assert f[(0, "ttft_ms", "mean")] == 15.0 and f[(0, "ttft_ms", "median")] == 15.0
    assert f[(0, "e2el_ms", "p90")] == pytest.approx(119.0)  # linear interpolation: 110 + 0.9 x 10
    assert f[(0, "tpot_ms", "mean")] == pytest.approx((115.0 - 15.0) / 10)
    assert f[(0, "request_throughput", "value")] == 1.0  # 2 finished over a 2 s stage
    assert f[(0, "output_throughput", "value")] == 11.0
    assert f[(1, "ttft_ms", "mean")] == 30.0  # the failed request is left out of latencies
    assert f[(1, "failed_pct", "value")] == 50.0 and f[(1, "saturated_pct", "value")] == 50.0
    assert f[(-1, "request_throughput", "value")] == 0.5  # 3 over the 6 s of both stages


def test_measured_formats(tmp_path, validation):
    general = validation / "20260217-231439-llama-2-7b-tp1-general.json"
    doc = json.loads(general.read_text())
    rows = pd.DataFrame(read_measured(general)).set_index(["stage", "metric", "stat"])["value"]
    st = doc["stages"][1]
    assert rows[(1, "ttft_ms", "median")] == st["ttft_ms"]["median"]
    # docs/simulator.md's rule: (E2E - TTFT) / (max_tokens - 1), not the file's per-event sse_tpot_ms
    assert rows[(1, "tpot_ms", "mean")] == pytest.approx((4158.15 - 51.854) / 247)
    assert rows[(1, "request_throughput", "value")] == pytest.approx(12000 / 600)
    life = {"load_summary": {"count": 10}, "failures": {"count": 2},
            "successes": {"count": 8, "output_len": {"mean": 5.0},
                          "latency": {"time_to_first_token": {"mean": 0.02, "median": 0.019, "p90": 0.03},
                                      "request_latency": {"mean": 0.1, "median": 0.09}},
                          "throughput": {"requests_per_sec": 4.0, "output_tokens_per_sec": 20.0}}}
    (tmp_path / "stage_1_lifecycle_metrics.json").write_text(json.dumps(life))
    lr = pd.DataFrame(read_measured(tmp_path)).set_index(["stage", "metric", "stat"])["value"]
    assert lr[(1, "ttft_ms", "p90")] == pytest.approx(30.0) and lr[(1, "e2el_ms", "mean")] == pytest.approx(100.0)
    assert lr[(1, "failed_pct", "value")] == 20.0
    # the report's output_len (5) and throughputs are the client's re-count and span the drain: without the run's
    # config.yaml there is no TPOT or throughput; with it, its output_len (ignore_eos) and stage durations
    assert (1, "tpot_ms", "mean") not in lr and (1, "request_throughput", "value") not in lr
    (tmp_path / "config.yaml").write_text("load: {stages: [{rate: 1, duration: 3}, {rate: 5, duration: 2}]}\n"
                                          "data: {type: shared_prefix, shared_prefix: {output_len: 9}}\n")
    lr = pd.DataFrame(read_measured(tmp_path)).set_index(["stage", "metric", "stat"])["value"]
    assert lr[(1, "tpot_ms", "mean")] == pytest.approx(80.0 / 8) and lr[(1, "request_throughput", "value")] == 4.0
    assert lr[(1, "output_throughput", "value")] == 8 * 9 / 2
    # a config the replay does not take (a newer inference-perf's key here) leaves them out, never the latencies
    (tmp_path / "config.yaml").write_text("load: {stages: [{rate: 1, duration: 3}], lora_traffic_split: null}\n")
    lr = pd.DataFrame(read_measured(tmp_path)).set_index(["stage", "metric", "stat"])["value"]
    assert (1, "tpot_ms", "mean") not in lr and lr[(1, "ttft_ms", "p90")] == pytest.approx(30.0)
    # a measured run's own reports give the figures its extracted JSON gives (7B: output_len ~200 of 248 generated)
    run = validation.parent / "inference-perf" / "20260217-231439-llama-2-7b-tp1-general"
    own = pd.DataFrame(read_measured(run)).set_index(["stage", "metric", "stat"])["value"]
    for key in ((1, "tpot_ms", "mean"), (0, "tpot_ms", "mean"), (1, "request_throughput", "value"),
                (1, "output_throughput", "value"), (1, "e2el_ms", "p90")):
        assert own[key] == pytest.approx(rows[key], rel=1e-4), key
    vb = tmp_path / "vb.json"
    vb.write_text(json.dumps({"duration": 10.0, "completed": 9, "failed": 1, "request_throughput": 0.9,
                              "mean_ttft_ms": 12.0, "p99_ttft_ms": 40.0, "mean_tpot_ms": 3.0}))
    vr = pd.DataFrame(read_measured(vb)).set_index(["stage", "metric", "stat"])["value"]
    assert vr[(-1, "ttft_ms", "p99")] == 40.0 and vr[(-1, "failed_pct", "value")] == 10.0


def test_compare_relative_errors():
    pred = pd.DataFrame({"stage": [0, 0], "metric": ["ttft_ms", "saturated_pct"], "stat": ["mean", "value"],
                         "value": [30.0, 0.0]})
    meas = pd.DataFrame({"source": ["m"], "stage": [0], "metric": ["ttft_ms"], "stat": ["mean"], "value": [25.0]})
    t = compare(pred, meas)
    row = t[t["metric"] == "ttft_ms"].iloc[0]
    assert row["rel_error"] == pytest.approx(0.2) and row["source"] == "m"
    assert t[t["metric"] == "saturated_pct"].iloc[0]["source"] == "m"


def test_compare_command_on_a_replayed_run(tmp_path):
    """A short replay (two stages), compared with a measured file written for it: the CSV, the report's
    section, and a stage-count mismatch refused in one line."""
    wl = tmp_path / "w.yaml"
    wl.write_text("load: {type: constant, stages: [{rate: 20, duration: 2}, {rate: 40, duration: 1}]}\n"
                  "server: {ignore_eos: true}\ndata: {type: shared_prefix, shared_prefix: {num_groups: 2, "
                  "num_prompts_per_group: 2, system_prompt_len: 32, question_len: 40, output_len: 8}}\n")
    run = tmp_path / "run"
    r = cli("run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-2-7b", "--workload-config", str(wl),
            "--strategies", "overlap", "--prefix-caching", "--out", str(run), "--no-progress")
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(run / "overlap" / "requests.parquet")
    assert list(np.bincount(df["stage"])) == [40, 40]
    measured = {"workload": {"max_tokens": 8},
                "stages": [{"rate_rps": 20, "duration_s": 2, "sent": 40, "succeeded": 40, "failed": 0,
                            "ttft_ms": {"mean": 20.0}, "e2e_latency_ms": {"mean": 100.0}},
                           {"rate_rps": 40, "duration_s": 1, "sent": 40, "succeeded": 40, "failed": 0,
                            "ttft_ms": {"mean": 25.0}, "e2e_latency_ms": {"mean": 120.0}}]}
    m = tmp_path / "m.json"
    m.write_text(json.dumps(measured))
    r = cli("compare", str(run), str(m))
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(run / "compare.csv")
    row = table[(table["stage"] == 1) & (table["metric"] == "ttft_ms")].iloc[0]
    assert row["predicted"] == pytest.approx(df[df["stage"] == 1]["ttft_ms"].mean())
    assert row["rel_error"] == pytest.approx(row["predicted"] / 25.0 - 1)
    assert "Predicted against measured" in (run / "report.html").read_text()
    measured["stages"] = measured["stages"][:1]
    m.write_text(json.dumps(measured))
    r = cli("compare", str(run), str(m))
    assert r.returncode == 2 and "2 load stages, the measured run 1" in r.stderr and "Traceback" not in r.stderr
