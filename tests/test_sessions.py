"""Multi-turn sessions (AIPerf's conversations): each turn is sent after the previous one's last token
plus its think time, with the session's history as the start of its prompt."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from harness.source import TraceSource
from harness.traces.fit import Fit, fit_trace
from harness.traces.formats import load_trace
from harness.traces.sessions import SessionShape
from harness.traces.synthetic import synthetic_trace
from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, assert_accounted, cli, reference_decode, tiny_models

SIM = ["--device", "sim", "--model-spec", "llama-3-8b", "--warmup", "0", "--no-progress"]


def _sessions(n_sessions: int, turns: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n_sessions):
        for t in range(turns):
            sampling = SamplingParams(temperature=1.0, seed=s * 10 + t) if s % 2 else SamplingParams()
            prompt = rng.integers(0, 512, size=int(rng.integers(3, 12)))
            out.append(Request(f"s{s}t{t}", prompt, int(rng.integers(2, 9)), sampling, arrival_s=0.0,
                               session_id=f"s{s}", turn=t))
    return out


@pytest.mark.parametrize("name", ["static", "inflight", "overlap"])
def test_each_turn_continues_its_history_as_the_reference_does(name):
    """Every turn's tokens equal a full recomputation of (earlier prompts and outputs, then its own prompt),
    the history assembled here from the test's own copy of each turn; with a large prefix cache each
    later turn reads the history's computed blocks from it."""
    eager, scripted = tiny_models()
    reqs = _sessions(4, 3)
    own = {r.request_id: r.prompt_token_ids.copy() for r in reqs}
    cfg = ExecutorConfig(max_batch_size=3, max_seq_len=128, tokens_per_block=4, max_num_tokens=32,
                         kv_blocks=200, prefix_caching=True)
    strategy = get_strategy(name)(TINY64, scripted, cfg)
    try:
        strategy.run(TraceSource(reqs))
    finally:
        strategy.close()
    assert_accounted(reqs)
    by_id = {r.request_id: r for r in reqs}
    for s in range(4):
        history: list[int] = []
        for t in range(3):
            r = by_id[f"s{s}t{t}"]
            prompt = history + own[r.request_id].tolist()
            assert r.status is Status.FINISHED and r.prompt_token_ids.tolist() == prompt
            alone = Request("ref", np.array(prompt), r.max_new_tokens, r.sampling)
            assert r.output_token_ids == reference_decode(eager, TINY64, alone), (name, r.request_id)
            if t:
                computed = len(history) - 1  # the previous turn's last token was sampled, never fed
                assert computed // 4 * 4 <= r.cached_tokens <= (len(prompt) - 1) // 4 * 4, r.request_id
                assert r.arrival_s == by_id[f"s{s}t{t - 1}"].finish_s
            history = prompt + r.output_token_ids


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_a_file_of_sessions_replays_its_think_times_and_caps_sessions(tmp_path):
    """Four sessions of three turns, all at t=0, two sessions at a time: each later turn is sent exactly
    its line's delay_s after its predecessor's last token, and at most two sessions are open at once
    (a session is open from its first send to its last token, think times included)."""
    lines = []
    for s in range(4):
        lines.append({"arrival_s": 0.0, "input_tokens": 60 + s, "output_tokens": 20, "session_id": f"u{s}", "turn": 0})
        for t in (1, 2):
            lines.append({"input_tokens": 30, "output_tokens": 10 + t, "session_id": f"u{s}", "turn": t,
                          "delay_s": 0.25 * t + 0.01 * s})
    path = _write(tmp_path / "s.jsonl", lines[::-1])  # file order does not matter
    out = tmp_path / "r"
    p = cli("run", *SIM, "--trace", path, "--strategies", "inflight", "--max-concurrency", "2", "--ignore-eos",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    req = pd.read_parquet(out / "inflight" / "requests.parquet").set_index(["session_id", "turn"])
    assert (req["status"] == "finished").all() and len(req) == 12
    for s in range(4):
        for t in (1, 2):
            sent = req.loc[(f"u{s}", t), "arrival_s"] - req.loc[(f"u{s}", t - 1), "finish_s"]
            assert sent == pytest.approx(0.25 * t + 0.01 * s, abs=1e-9)
            history = req.loc[(f"u{s}", t - 1), "input_tokens"] + req.loc[(f"u{s}", t - 1), "output_tokens"]
            assert req.loc[(f"u{s}", t), "input_tokens"] == history + 30
    spans = req.reset_index().groupby("session_id").agg(start=("arrival_s", "min"), end=("finish_s", "max"))
    edges = sorted([(x, 1) for x in spans["start"]] + [(x, -1) for x in spans["end"]], key=lambda e: (e[0], e[1]))
    assert max(np.cumsum([d for _, d in edges])) == 2


def test_a_rejected_turn_ends_its_session(tmp_path):
    """Turn 1 of session a outgrows --max-seq-len with its history: it is rejected, turn 2 is never sent
    and says why; session b is served whole; the run exits 0 and prints the rejections."""
    lines = [{"arrival_s": 0.0, "input_tokens": 100, "output_tokens": 50, "session_id": "a", "turn": 0},
             {"input_tokens": 100, "output_tokens": 60, "session_id": "a", "turn": 1, "delay_s": 0.1},
             {"input_tokens": 10, "output_tokens": 10, "session_id": "a", "turn": 2, "delay_s": 0.1},
             {"arrival_s": 0.5, "input_tokens": 20, "output_tokens": 10, "session_id": "b", "turn": 0},
             {"input_tokens": 20, "output_tokens": 10, "session_id": "b", "turn": 1}]
    out = tmp_path / "r"
    p = cli("run", *SIM, "--trace", _write(tmp_path / "s.jsonl", lines), "--strategies", "static,inflight",
            "--ignore-eos", "--max-seq-len", "256", "--goodput", "e2el:100000", "--out", str(out))
    assert p.returncode == 0, p.stderr
    # every finished turn meets the loose SLO: 3 of the 4 turns sent (turn a/2 never was)
    summary = pd.read_csv(out / "summary.csv").set_index("strategy")
    assert summary.loc["inflight", "slo_attainment"] == pytest.approx(3 / 4)
    for strategy in ("static", "inflight"):
        req = pd.read_parquet(out / strategy / "requests.parquet").set_index(["session_id", "turn"])
        assert req.loc[("a", 1), "status"] == "rejected" and "exceeds max_seq_len" in req.loc[("a", 1), "finish_reason"]
        assert req.loc[("a", 2), "status"] == "rejected"
        assert req.loc[("a", 2), "finish_reason"].startswith("session ended at turn 1 (rejected: prompt (250)")
        assert (req.loc["b", "status"] == "finished").all() and req.loc[("a", 0), "status"] == "finished"
    assert "inflight rejected 2 of 5 requests (1 of them later turns of sessions that ended there)" in p.stdout


@pytest.mark.parametrize(("lines", "message"), [
    ([{"input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 1}], ":1: session 'x': turn 1 without turn 0"),
    ([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 0},
      {"arrival_s": 1, "input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 0}],
     ":2: session 'x': turn 0 again (first on line 1)"),
    ([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 0},
      {"input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 2, "delay_s": 1}], "turn 2 without turn 1"),
    ([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 0},
      {"input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 1, "delay_s": -0.5}],
     ":2: delay_s: -0.5 is negative"),
    ([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 0},
      {"arrival_s": 3, "input_tokens": 5, "output_tokens": 5, "session_id": "x", "turn": 1}], "arrival_s on turn 1"),
    ([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "turn": 0}], "turn and delay_s need a session_id"),
    ([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "session_id": "x"}], "session_id without turn"),
])
def test_bad_sessions_are_one_line_exit_2(tmp_path, lines, message):
    p = cli("run", *SIM, "--trace", _write(tmp_path / "bad.jsonl", lines), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--session-turn-delay-mean", "-5"], "--session-turn-delay-mean must be >= 0"),
    (["--session-turns-mean", "0.5"], "--session-turns-mean must be >= 1"),
    (["--session-turns-stddev", "-1"], "--session-turns-stddev must be >= 0"),
])
def test_bad_session_options_are_one_line_exit_2(tmp_path, args, message):
    p = cli("run", *SIM, "--num-prompts", "5", *args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_synthetic_sessions_follow_aiperfs_distributions():
    """20,000 turns, sessions of 5 ± 2 turns with 800 ± 300 ms think times: the turns add up to the count
    asked for, every session but the last is whole, and the sample means and spreads are the options'
    (law of large numbers: within 3%; think times are normal, so clipping at 0 is negligible at 2.7
    sigma). The single-turn trace of the same seed is unchanged by the session options' presence."""
    shape = SessionShape(5, 2, 800, 300)
    reqs = synthetic_trace(20_000, 32, 16, request_rate=4.0, seed=7, sessions=shape).requests
    df = pd.DataFrame({"s": [r.session_id for r in reqs], "t": [r.turn for r in reqs], "d": [r.delay_s for r in reqs],
                       "a": [r.arrival_s for r in reqs]})
    turns = df.groupby("s", sort=False)["t"].agg(["count", "max"])
    assert len(df) == 20_000 and ((turns["max"] + 1) == turns["count"]).all()
    whole = turns["count"].iloc[:-1]
    assert whole.mean() == pytest.approx(5, rel=0.03) and whole.std() == pytest.approx(2, rel=0.05)
    later = df[df["t"] > 0]["d"] * 1e3
    assert later.mean() == pytest.approx(800, rel=0.03) and later.std() == pytest.approx(300, rel=0.05)
    assert (df[df["t"] == 0]["d"] == 0).all()
    starts = df[df["t"] == 0]["a"].to_numpy()  # sessions start at the request rate
    assert len(starts) / starts[-1] == pytest.approx(4.0, rel=0.05)
    single = synthetic_trace(50, 32, 16, request_rate=4.0, seed=7)
    assert single == synthetic_trace(50, 32, 16, request_rate=4.0, seed=7, sessions=SessionShape())


def test_fitting_keeps_a_session_whole_and_in_order(tmp_path):
    """--start-offset drops a session whole (its later turns share its first arrival); --limit keeps a
    prefix, never a turn without its predecessors; --time-scale scales think times too."""
    lines = [{"arrival_s": 0.0, "input_tokens": 5, "output_tokens": 5},
             {"input_tokens": 5, "output_tokens": 5, "session_id": 7, "turn": 1, "delay_s": 2.0},
             {"arrival_s": 1.0, "input_tokens": 5, "output_tokens": 5, "session_id": 7, "turn": 0},
             {"arrival_s": 1.5, "input_tokens": 5, "output_tokens": 5},
             {"input_tokens": 5, "output_tokens": 5, "session_id": 7, "turn": 2, "delay_s": 1.0}]
    trace = load_trace(_write(tmp_path / "t.jsonl", lines))
    assert [(r.session_id, r.turn) for r in trace.requests] == [(None, 0), ("7", 0), ("7", 1), ("7", 2), (None, 0)]
    late = fit_trace(trace, Fit(start_offset_s=0.5, time_scale=0.5))
    assert [(r.session_id, r.turn, r.delay_s) for r in late.requests] == [("7", 0, 0.0), ("7", 1, 1.0), ("7", 2, 0.5),
                                                                         (None, 0, 0.0)]
    assert [(r.session_id, r.turn) for r in fit_trace(trace, Fit(limit=3)).requests] == [(None, 0), ("7", 0), ("7", 1)]
