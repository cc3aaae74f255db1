"""Suites on Ray (a real local Ray, not a mock), resume, failures, interrupts, and repeated runs."""

import json
import math
import signal
import statistics
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from harness.options import RunOptions
from harness.suite.execute import execute_suite
from harness.suite.on_ray import run_on_ray
from harness.suite.run import run_suite
from harness.suite.spec import expand
from reports.repeats import repeat_table, t975
from tests.util import wait_for_progress

ray = pytest.importorskip("ray")
# One local Ray at a time on this machine: every test here runs on the same xdist worker.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the in-process tests below (a start costs seconds): ``run_on_ray`` and the
    capacity search use a Ray that is already up and leave it running."""
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()

SIM = """
name = "grid"
repeats = 2
[defaults]
device = "sim"
model_spec = "llama-3-8b"
gpu = "h100"
num_prompts = 30
host_time = "modelled"        # virtual time only: a run's figures do not depend on where it ran
host_ms_per_iteration = 0.5
strategies = ["inflight", "overlap"]
[sweep]
request_rate = [5.0, 20.0]
"""
WALL_CLOCK = ["wall_s"]  # the only column that measures the machine, not the run


def files(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_a_suite_on_ray_writes_what_the_sequential_suite_writes(tmp_path, local_ray):
    path = tmp_path / "grid.toml"
    path.write_text(SIM)
    code_seq, seq, _ = run_suite(path, tmp_path / "seq", progress=False)
    code_ray, on_ray, _ = run_suite(path, tmp_path / "ray", progress=False, ray_address="")
    assert code_seq == code_ray == 0
    assert files(seq) == files(on_ray) and "request_rate=20.0@r1/overlap/requests.parquet" in files(seq)
    a, b = pd.read_csv(seq / "summary.csv"), pd.read_csv(on_ray / "summary.csv")
    assert len(a) == 8
    pd.testing.assert_frame_equal(a.drop(columns=WALL_CLOCK), b.drop(columns=WALL_CLOCK))
    assert json.loads((seq / "suite.json").read_text()) == json.loads((on_ray / "suite.json").read_text())
    for run in ("request_rate=5.0@r0", "request_rate=5.0@r1"):  # each repeat on its own seed
        seed = json.loads((on_ray / run / "run.json").read_text())["seed"]
        assert seed == int(run[-1])


def test_a_dead_worker_is_retried_then_recorded_and_the_others_are_kept(tmp_path, local_ray):
    runs = expand([("a", {}, RunOptions(device="sim", num_prompts=5, host_time="modelled")),
                   ("b", {}, RunOptions(device="sim", num_prompts=5, host_time="modelled"))], 1)
    (tmp_path / "out").mkdir()
    results, interrupted = run_on_ray(runs, tmp_path / "out", "", False, die_in=frozenset({"b"}))
    assert not interrupted
    assert results["a"].exit_code == 0 and results["a"].error is None
    assert results["b"].exit_code == 1 and "died" in results["b"].error.lower()
    assert (tmp_path / "out" / "a" / "summary.csv").is_file() and not (tmp_path / "out" / "b").exists()


def test_resume_runs_only_what_is_missing_and_a_failed_run_fails_the_suite(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(SIM.replace("repeats = 2", "repeats = 1"))
    code, out, _ = run_suite(path, tmp_path / "o", progress=False)
    assert code == 0
    kept = (out / "request_rate=5.0" / "run.json").stat().st_mtime_ns
    import shutil

    shutil.rmtree(out / "request_rate=20.0")
    code, out, summary = run_suite(path, out, progress=False, resume=True)
    assert code == 0 and (out / "request_rate=20.0" / "summary.csv").is_file()
    assert (out / "request_rate=5.0" / "run.json").stat().st_mtime_ns == kept  # not run again
    statuses = {e["name"]: e["status"] for e in json.loads((out / "suite.json").read_text())["runs"]}
    assert statuses == {"request_rate=5.0": "resumed", "request_rate=20.0": "ok"}
    assert len(summary) == 4
    bad = expand([("ok", {}, RunOptions(device="sim", num_prompts=5, host_time="modelled")),
                  ("missing", {}, RunOptions(trace=str(tmp_path / "nope.jsonl"), model="tiny"))], 1)
    code, out, summary = execute_suite("bad", "test", None, bad, tmp_path / "bad", progress=False)
    entries = {e["name"]: e for e in json.loads((out / "suite.json").read_text())["runs"]}
    assert code == 1 and entries["ok"]["status"] == "ok" and entries["missing"]["status"] == "failed"
    assert "nope.jsonl" in entries["missing"]["error"] and set(summary["run"]) == {"ok"}


def test_ctrl_c_cancels_the_outstanding_tasks_and_keeps_what_finished(tmp_path):
    path = tmp_path / "many.toml"
    path.write_text(SIM.replace("repeats = 2", "repeats = 12").replace("num_prompts = 30", "num_prompts = 200"))
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "suite", str(path), "--ray", "--out",
                             str(tmp_path / "o")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_progress(proc, "runs", 1, timeout_s=180)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    entries = json.loads((tmp_path / "o" / "suite.json").read_text())["runs"]
    statuses = [e["status"] for e in entries]
    assert "ok" in statuses and "not run" in statuses and len(entries) == 24
    done = {e["name"] for e in entries if e["status"] == "ok"}
    assert set(pd.read_csv(tmp_path / "o" / "summary.csv")["run"]) == done


def test_t_quantiles_match_the_published_table():
    # t_{0.975} from a printed table of Student's t (df 1, 2, 4, 10, 30, 40, 60, 120)
    for df, t in [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (40, 2.021), (60, 2.000),
                  (120, 1.980)]:
        assert t975(df) == pytest.approx(t, abs=1.5e-3), df


def test_repeat_statistics_against_the_statistics_module(tmp_path):
    out = tmp_path / "r"
    p = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--device", "sim", "--num-prompts", "20",
                        "--request-rate", "8", "--strategies", "inflight", "--repeats", "3", "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = pd.read_csv(out / "summary.csv")
    assert list(rows["run"]) == ["run@r0", "run@r1", "run@r2"] and list(rows["seed"]) == [0, 1, 2]
    stats = pd.read_csv(out / "summary_repeats.csv").iloc[0]
    x = list(rows["output_throughput"])
    assert stats["repeats"] == 3 and len(set(x)) == 3  # the seeds change the trace
    assert stats["output_throughput_mean"] == pytest.approx(statistics.mean(x))
    assert stats["output_throughput_ci95"] == pytest.approx(4.303 * statistics.stdev(x) / math.sqrt(3), rel=1e-3)
    assert stats["output_throughput_cv"] == pytest.approx(statistics.stdev(x) / statistics.mean(x))
    assert "Repeats" in (out / "report.html").read_text()
    assert repeat_table(pd.DataFrame()).empty


CAPACITY = """
name = "cap"
[defaults]
device = "sim"
gpu = "h200"
model_spec = "llama-3-8b"
num_prompts = 60
input_len = 512
output_len = 64
ignore_eos = true
host_time = "modelled"
host_ms_per_iteration = 1.0
strategies = ["inflight"]
max_batch_size = 16
max_seq_len = 2048
[capacity]
goodput = ["ttft:300", "tpot:30"]
min_fraction = 0.9
rate_lo = 0.5
rate_hi = 64.0
tolerance = 0.2
"""


def test_capacity_search_brackets_the_highest_rate_that_meets_the_slos(tmp_path, local_ray):
    path = tmp_path / "cap.toml"
    path.write_text(CAPACITY)
    code, out, _ = run_suite(path, tmp_path / "seq", progress=False)
    assert code == 0
    table = pd.read_csv(out / "capacity.csv")
    points = pd.read_csv(out / "capacity_points.csv")
    row = table.iloc[0]
    assert row["status"] == "bracketed" and 0.5 < row["max_rate"] < 64
    assert row["runs"] == len(points)
    # A bisection, read off the evaluations in order: each rate after the first two is the geometric middle of
    # the bracket the earlier ones left (highest rate that met the SLOs, lowest that did not), and the search
    # stops as soon as that bracket is within the tolerance, not before and not after.
    lo, hi = 0.5, 64.0
    for i, p in enumerate(points.itertuples()):
        if i >= 2:
            assert hi / lo > 1.2 and p.request_rate == pytest.approx(math.sqrt(lo * hi), rel=1e-6), (i, lo, hi)
        if p.meets:
            lo = max(lo, p.request_rate)
        else:
            hi = min(hi, p.request_rate)
    failing = points[~points["meets"].astype(bool)]["request_rate"]
    assert hi / lo <= 1.2 and (lo, hi) == (row["max_rate"], failing.min())
    at = points.set_index("request_rate")
    assert at.loc[row["max_rate"], "slo_attainment"] >= 0.9
    assert not (failing < row["max_rate"]).any()  # attainment fell as the rate rose
    # --resume asks for the same rates and reruns only the evaluation that is missing
    import shutil

    shutil.rmtree(out / "default.inflight@rate=64")
    run_suite(path, out, progress=False, resume=True)
    pd.testing.assert_frame_equal(pd.read_csv(out / "capacity.csv"), table)
    statuses = [e["status"] for e in json.loads((out / "suite.json").read_text())["runs"]]
    assert statuses.count("ok") == 1 and statuses.count("resumed") == len(points) - 1
    # the same search as Ray tasks finds the same capacity
    code, out_ray, _ = run_suite(path, tmp_path / "ray", progress=False, ray_address="")
    pd.testing.assert_frame_equal(pd.read_csv(out_ray / "capacity.csv"), table)
    assert "Capacity: Pareto" in (out_ray / "report.html").read_text()


def test_pareto_front_against_brute_force():
    from reports.capacity import pareto_front

    rng = np.random.default_rng(0)
    for _ in range(50):
        x, y = rng.integers(0, 20, 30).astype(float), rng.integers(0, 20, 30).astype(float)
        brute = {i for i in range(30)
                 if not any((x[j] >= x[i] and y[j] >= y[i]) and (x[j] > x[i] or y[j] > y[i]) for j in range(30))}
        got = set(pareto_front(x, y).tolist())
        # ties (equal points) keep one representative: compare as sets of coordinates
        assert {(x[i], y[i]) for i in got} == {(x[i], y[i]) for i in brute}
