"""The CLI end to end, in subprocesses, on the tiny model: output contract, metrics, errors, faults."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from harness.metrics import request_metrics
from harness.output.records import read_tokens
from reports.token_times import TokenTimes
from tests.util import wait_for_progress

pytestmark = pytest.mark.xdist_group("cli")  # one worker: its module fixture is built once

TINY = ["--model", "tiny", "--num-prompts", "40", "--input-len", "24", "--output-len", "12", "--max-batch-size", "8",
        "--max-seq-len", "64", "--warmup", "2", "--no-progress"]


def slotbench(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "r"
    # (TTFT <= 20 ms: static's later batches queue for ~10x that, its first ones do not — the SLO splits its requests)
    p = slotbench("run", *TINY, "--out", str(out), "--request-rate", "200", "--goodput", "ttft:20", "tpot:50",
                  "--metric-percentiles", "50,90,99.9", "--temperature", "0.8", "--top-p", "0.9")
    assert p.returncode == 0, p.stderr
    return out


def test_output_contract(run_dir):
    for f in ("run.json", "summary.csv", "summary.json", "report.html"):
        assert (run_dir / f).is_file(), f
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["seed"] == 0 and meta["device"] == "cpu" and meta["versions"]["torch"].startswith("2.")
    assert meta["trace"]["source"] == "synthetic" and meta["options"]["request_rate"] == 200
    for s in ("static", "inflight", "overlap"):
        req = pd.read_parquet(run_dir / s / "requests.parquet")
        for col in ("request_id", "arrival_s", "input_tokens", "output_tokens", "status", "finish_reason",
                    "first_token_s", "finish_s", "slot", "preemptions"):
            assert col in req.columns
        assert len(req) == 40 and set(req["status"]) == {"finished"}
        it = pd.read_parquet(run_dir / s / "iterations.parquet")
        assert len(it) > 0 and (it["sample_end_s"] >= it["forward_start_s"]).all()
        trace = json.loads((run_dir / s / "timeline.json").read_text())
        names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert names == {"schedule", "prepare", "postprocess", "forward", "sample"}


def test_timeline_times_are_the_iterations_rounded_as_python_rounds(run_dir):
    """Each phase slice is its iteration's start and length in microseconds, ``round(x, 3)`` as Python
    rounds (the timeline rounds them as arrays); and so is every value of the vectorised rounding, halves
    and values just beside a half included."""
    from harness.output.timeline import microseconds

    it = pd.read_parquet(run_dir / "inflight" / "iterations.parquet").set_index("iteration")
    events = [e for e in json.loads((run_dir / "inflight" / "timeline.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    assert len(events) == 5 * len(it)
    for e in events:
        start, end = it.loc[e["args"]["iteration"], [f"{e['name']}_start_s", f"{e['name']}_end_s"]]
        assert (e["ts"], e["dur"]) == (round(start * 1e6, 3), round(max(end - start, 0.0) * 1e6, 3))
    rng = np.random.default_rng(3)
    for longest_s in (1, 3600, 10**7):  # up to 115 days, where x * 1000's doubles lie 2 apart
        halves = (rng.integers(0, longest_s * 10**9, 20_000) + 0.5) / 1e9  # x * 1e6 at or within an ulp of a half
        values = np.concatenate((rng.uniform(0, longest_s, 20_000), halves, np.nextafter(halves, 0), [0.0, 2.5e-9]))
        assert microseconds(values) == [round(v * 1e6, 3) for v in values.tolist()], longest_s


def test_summary_is_recomputable_from_requests_and_tokens(run_dir):
    summary = pd.read_csv(run_dir / "summary.csv")
    assert list(summary["strategy"]) == ["static", "inflight", "overlap"]
    split = False
    for _, row in summary.iterrows():
        req = pd.read_parquet(run_dir / row["strategy"] / "requests.parquet")
        tokens = read_tokens((run_dir / row["strategy"] / "tokens.jsonl").read_text())
        again = request_metrics(req, TokenTimes.of(tokens, req["request_id"]), (50, 90, 99.9),
                                {"ttft": 20.0, "tpot": 50.0})
        for key, value in again.items():
            assert row[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
        # and by hand, from first principles, for a few of them
        done = req[req["status"] == "finished"]
        ttft = (done["first_token_s"] - done["arrival_s"]) * 1e3
        assert row["mean_ttft_ms"] == pytest.approx(ttft.mean())
        assert row["p99_9_ttft_ms"] == pytest.approx(np.percentile(ttft, 99.9))
        gaps = np.concatenate([np.diff(tokens[r]) for r in done["request_id"]]) * 1e3
        assert row["mean_itl_ms"] == pytest.approx(gaps.mean())
        assert row["std_itl_ms"] == pytest.approx(gaps.std())
        duration = done["finish_s"].max() - req["arrival_s"].min()
        assert row["output_throughput"] == pytest.approx(done["output_tokens"].sum() / duration)
        # vllm bench serve's definitions (vllm/benchmarks/serve.py, calculate_metrics), each computed here from
        # the requests file: TPOT = (E2EL - TTFT) / (n - 1) over requests with n > 1; E2EL = finish - arrival;
        # a good request meets every SLO given (TTFT <= 20 ms, TPOT <= 50 ms, a one-token request's TPOT
        # counted as 0); goodput = good / duration; slo_attainment = good / requests sent (all of them here)
        n = done["output_tokens"]
        e2el = (done["finish_s"] - done["arrival_s"]) * 1e3
        tpot = ((e2el - ttft) / (n - 1))[n > 1]
        assert row["mean_tpot_ms"] == pytest.approx(tpot.mean()) and row["p90_tpot_ms"] == pytest.approx(
            np.percentile(tpot, 90))
        assert row["mean_e2el_ms"] == pytest.approx(e2el.mean()) and row["median_e2el_ms"] == pytest.approx(
            e2el.median())
        good = int(((ttft <= 20) & (((e2el - ttft) / (n - 1)).where(n > 1, 0.0) <= 50)).sum())
        assert row["request_goodput"] == pytest.approx(good / duration)
        assert row["slo_attainment"] == pytest.approx(good / len(req))
        split |= 0 < good < len(done)
    assert split, "the SLOs split some strategy's requests: both sides of the rule are checked"


def test_token_times_are_postprocess_times(run_dir):
    req = pd.read_parquet(run_dir / "inflight" / "requests.parquet")
    tokens = [json.loads(line) for line in (run_dir / "inflight" / "tokens.jsonl").read_text().splitlines()]
    by_id = {t["request_id"]: t for t in tokens}
    it = pd.read_parquet(run_dir / "inflight" / "iterations.parquet").sort_values("postprocess_start_s")
    for _, r in req.iterrows():
        t = by_id[r["request_id"]]
        assert len(t["tokens"]) == len(t["times_s"]) == r["output_tokens"]
        assert t["times_s"][0] == r["first_token_s"] and t["times_s"][-1] == r["finish_s"]
        assert all(b >= a for a, b in zip(t["times_s"], t["times_s"][1:], strict=False))
        assert r["first_token_s"] >= r["arrival_s"]
    # A token is stamped inside the postprocess of the step that made it, once the host holds it: after
    # that step ended on the device (in-flight postprocesses step n before it launches n + 1).
    lo, hi = it["postprocess_start_s"].to_numpy(), it["postprocess_end_s"].to_numpy()
    device_end = it["sample_end_s"].to_numpy()
    for t in tokens:
        for x in t["times_s"]:
            step = np.searchsorted(lo, x, side="right") - 1
            assert step >= 0 and x <= hi[step] and x >= device_end[step]


def test_refuses_to_overwrite_without_force(run_dir):
    p = slotbench("run", *TINY, "--out", str(run_dir))
    assert p.returncode == 2 and "exists; pass --force" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--strategies", "static,dynamic"], "unknown strategy 'dynamic'; valid: "),
    (["--max-batch-size", "0"], "--max-batch-size must be positive"),
    (["--max-num-tokens", "8"], "smaller than one KV block"),
    (["--metric-percentiles", "50,100"], "each must be in (0, 100)"),
    (["--goodput", "ttft=5"], "expected METRIC:MS"),
    (["--goodput", "itl:5"], "expected METRIC:MS"),
    (["--trace", "/nonexistent/trace.csv"], "/nonexistent/trace.csv: no such file"),
    (["--trace-format", "parquet"], "invalid choice"),
    (["--model", "gpt-17"], "not a preset"),
    (["--request-rate", "abc"], "invalid float value"),
    (["--device", "tpu"], "--device 'tpu': expected cpu, cuda[:N] or sim"),
    (["--temperature", "-1"], "sampling options: temperature must be >= 0"),
    (["--top-p", "0"], "sampling options: top_p must be in (0, 1]"),
    (["--seed", "-3"], "--seed must be >= 0"),
    (["--strategies", "inflight,hf-cb", "--device", "sim"], "hf-cb runs transformers on the CPU only"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    p = slotbench("run", *TINY, "--out", str(tmp_path / "x"), *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "x").exists()


def test_bad_trace_row_names_file_and_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 2}\n'
                     '{"arrival_s": 1, "input_tokens": -5, "output_tokens": 2}\n')
    p = slotbench("run", *TINY, "--trace", str(trace), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and f"{trace}:2: input_tokens: -5 is not a positive token count" in p.stderr


def test_a_generated_request_id_that_is_another_lines_id_is_refused(tmp_path):
    """Line 2 has no id, so slotbench would call it "1" (its index), which line 1 is called: the metrics,
    kept per id, would merge the two requests' token times. One line, exit 2, no run directory; with the
    clash removed the same trace runs."""
    trace = tmp_path / "t.jsonl"
    line = '{{"arrival_s": {t}, "input_tokens": 5, "output_tokens": 2{rid}}}\n'
    trace.write_text(line.format(t=0, rid=', "request_id": "1"') + line.format(t=1, rid=""))
    p = slotbench("run", "--device", "sim", "--trace", str(trace), "--out", str(tmp_path / "x"))
    assert p.returncode == 2, p.stderr
    assert "trace request 1 has no request_id, and the one slotbench would give it, '1', is another line's" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "x").exists()
    trace.write_text(line.format(t=0, rid=', "request_id": "a"') + line.format(t=1, rid=""))
    ok = slotbench("run", "--device", "sim", "--trace", str(trace), "--out", str(tmp_path / "y"), "--no-progress")
    assert ok.returncode == 0, ok.stderr
    ids = pd.read_parquet(tmp_path / "y" / "inflight" / "requests.parquet")["request_id"].tolist()
    assert sorted(ids) == ["1", "a"]


def test_trace_info(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i * 500}, "input_length": {10 + i}, "output_length": 3}}\n'
                             for i in range(5)))
    p = slotbench("trace-info", str(trace))
    info = json.loads(p.stdout)
    assert p.returncode == 0 and info["rows"] == 5 and info["duration_s"] == 2.0 and info["input_p50"] == 12


def test_replay_with_fitting(tmp_path, shared_traces):
    out = tmp_path / "az"
    p = slotbench("run", *TINY, "--strategies", "inflight", "--trace",
                  str(shared_traces / "azure2023" / "AzureLLMInferenceTrace_conv.csv"), "--limit", "30",
                  "--time-scale", "0.01", "--max-input-len", "40", "--max-output-len", "10", "--out", str(out))
    assert p.returncode == 0, p.stderr
    req = pd.read_parquet(out / "inflight" / "requests.parquet")
    assert len(req) == 30 and req["input_tokens"].max() <= 40 and (req["status"] == "finished").all()
    assert json.loads((out / "run.json").read_text())["trace"]["format"] == "azure"


def test_engine_fault_keeps_what_was_measured(tmp_path):
    out = tmp_path / "f"
    p = slotbench("run", *TINY, "--out", str(out), env={"SLOTBENCH_INJECT_FAULT": "inflight:5"})
    assert p.returncode == 1
    assert "error: inflight stopped early: RuntimeError: injected engine fault at iteration 5" in p.stderr
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["status"]) == ["ok", "stopped", "ok"]  # the other strategies still ran
    req = pd.read_parquet(out / "inflight" / "requests.parquet")
    it = pd.read_parquet(out / "inflight" / "iterations.parquet")
    # iterations 0-4 complete; 5 was scheduled and launched, and its device step raised
    assert list(it["iteration"]) == [0, 1, 2, 3, 4, 5]
    assert it["sample_end_s"].iloc[:5].notna().all() and np.isnan(it["sample_end_s"].iloc[5])
    assert (req["status"] == "failed").all()
    assert req["finish_reason"].str.contains("injected engine fault").all()
    assert (out / "report.html").is_file()


def test_sigint_writes_what_was_measured_and_exits_130(tmp_path):
    out = tmp_path / "i"
    args = [sys.executable, "-m", "harness.cli", "run", "--model", "tiny", "--num-prompts", "3000",
            "--request-rate", "100", "--max-seq-len", "64", "--input-len", "24", "--output-len", "12",
            "--warmup", "0", "--strategies", "inflight,overlap", "--out", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_progress(proc, "inflight", 50)  # some requests finished, most not yet arrived
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["strategy"]) == ["inflight"]  # overlap never started
    req = pd.read_parquet(out / "inflight" / "requests.parquet")
    assert len(req) == 3000
    assert set(req["status"]) <= {"finished", "failed"} and (req["status"] == "failed").any()
    assert (req["status"] == "finished").any()
    assert req.loc[req["status"] == "failed", "finish_reason"].eq("interrupted (SIGINT)").all()


def test_console_script_leaves_without_teardown_yet_loses_nothing(tmp_path):
    """``slotbench`` (``cli.entry``) skips the interpreter's teardown with ``os._exit``: its exit codes,
    piped stdout and files are those of ``main``, and exit handlers still run (here one writes a marker)."""
    hook = "import atexit, pathlib, sys; m = pathlib.Path(sys.argv.pop()); atexit.register(m.write_text, 'ran'); "
    entry = [sys.executable, "-c", hook + "from harness.cli import entry; entry()"]
    sim = ["run", "--device", "sim", "--model-spec", "llama-3-8b", "--num-prompts", "20", "--strategies", "inflight"]
    out = tmp_path / "r"
    p = subprocess.run([*entry, *sim, "--out", str(out), str(tmp_path / "marker")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "inflight" in p.stdout and p.stdout.endswith("\n")  # the summary table, flushed through the pipe
    assert len(pd.read_parquet(out / "inflight" / "requests.parquet")) == 20 and (out / "report.html").is_file()
    assert (tmp_path / "marker").read_text() == "ran"
    bad = subprocess.run([*entry, *sim, "--max-batch-size", "0", "--out", str(tmp_path / "x"), str(tmp_path / "m2")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--max-batch-size must be positive" in bad.stderr
    assert (tmp_path / "m2").read_text() == "ran"


def test_a_device_process_dead_at_start_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """A device process that dies while it starts (or in warm-up) ended the run with a traceback and no files:
    now the strategy stops with one line, its requests fail with the reason, the others still run, and the
    run directory is written (exit 1, as any engine fault)."""
    from harness.cli import main
    from strategies.runtime.device import process

    real = process.DeviceServer.acquire
    calls = {"n": 0}

    def dies_once(cls):
        calls["n"] += 1
        if calls["n"] == 1:  # the first strategy's warm-up engine
            raise RuntimeError("the device process exited at start (code -9)")
        return real()

    monkeypatch.setattr(process.DeviceServer, "acquire", classmethod(dies_once))
    out = tmp_path / "f"
    code = main(["run", *TINY, "--strategies", "static,inflight", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "error: static stopped early: RuntimeError: the device process exited at start (code -9)" in err
    summary = pd.read_csv(out / "summary.csv").set_index("strategy")
    assert summary.loc["static", "status"] == "stopped" and summary.loc["inflight", "status"] == "ok"
    req = pd.read_parquet(out / "static" / "requests.parquet")
    assert (req["status"] == "failed").all() and req["finish_reason"].str.contains("exited at start").all()
