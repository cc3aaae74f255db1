"""The slot tenure book (slots.parquet) and the buffer set of each step (iterations.parquet's buffer_set),
checked against what other parts of the runtime record independently: the active slots counted from the
free list at each schedule, the generation rows the scheduler packed, each request's preemptions."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from reports import buffers
from reports.load import load_run
from tests.util import cli

# Preemption (max-utilization on a small pool) and chunked prefill; on the simulated device: the host code
# under test is the real one, and a run takes seconds
PREEMPTING = ["--device", "sim", "--model-spec", "tiny", "--num-prompts", "120", "--input-len", "40",
              "--output-len", "40", "--max-batch-size", "16", "--max-seq-len", "128", "--capacity-policy",
              "max-utilization", "--kv-blocks", "40", "--chunked-prefill", "--max-num-tokens", "64", "--warmup", "0",
              "--no-progress"]
BEAMS = ["--device", "sim", "--model-spec", "tiny", "--num-prompts", "60", "--input-len", "40", "--output-len", "30",
         "--max-batch-size", "8", "--max-seq-len", "128", "--beam-width", "3", "--warmup", "0", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("slots")
    out = {}
    for name, args in (("preempting", [*PREEMPTING, "--strategies", "static,inflight,overlap,pipeline"]),
                       ("beams", [*BEAMS, "--strategies", "static,inflight,overlap"]),
                       ("cpu", ["--model", "tiny", "--strategies", "static,inflight,overlap", "--num-prompts", "24",
                                "--input-len", "16", "--output-len", "12", "--max-batch-size", "6", "--warmup", "0",
                                "--no-progress"])):
        p = cli("run", *args, "--out", str(root / name))
        assert p.returncode == 0, p.stderr
        out[name] = load_run(root / name)
    return out


def _per_iteration(tenures: pd.DataFrame, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the tenures alone, per iteration: slots held, rows of slots past their prefill, slots in prefill."""
    held, decoding, prefilling = np.zeros(n, int), np.zeros(n, int), np.zeros(n, int)
    for t in tenures.itertuples():
        decode = t.decode_iteration if t.decode_iteration >= 0 else t.end_iteration + 1
        held[t.start_iteration: t.end_iteration + 1] += 1
        decoding[decode: t.end_iteration + 1] += t.width
        prefilling[t.start_iteration: min(decode, t.end_iteration + 1)] += 1
    return held, decoding, prefilling


@pytest.mark.parametrize("run_name", ["preempting", "beams", "cpu"])
def test_tenures_agree_with_the_iteration_and_request_records(runs, run_name):
    run = runs[run_name]
    for strategy, t in run.slots.items():
        it, req = run.iterations[strategy], run.requests[strategy].set_index("request_id")
        assert len(t) and (t["end_iteration"] >= t["start_iteration"]).all(), strategy
        for slot, g in t.sort_values("start_iteration").groupby("slot"):  # one holder at a time
            assert (g["start_iteration"].to_numpy()[1:] > g["end_iteration"].to_numpy()[:-1]).all(), (strategy, slot)
        held, decoding, prefilling = _per_iteration(t, int(it["iteration"].max()) + 1)
        i = it["iteration"].to_numpy()
        # the free list's count at each schedule equals the tenures covering that step
        assert (held[i] == it["active_slots"].to_numpy()).all(), strategy
        # every generation row is a slot past its prefill; every context chunk a slot in its prefill
        assert (decoding[i] >= it["num_generation_requests"].to_numpy()).all(), strategy
        assert (prefilling[i] >= it["num_context_requests"].to_numpy()).all(), strategy
        if strategy == "inflight" or (strategy == "overlap" and run_name != "beams"):
            # these compute every slot past its prefill at every step (overlap's beam requests keep their
            # slot, idle, until their finish is read; static waits for its batch's prefills; the pipeline
            # computes a slot in its micro-batch's steps only)
            assert (decoding[i] == it["num_generation_requests"].to_numpy()).all(), strategy
        per_request = t.groupby("request_id")
        assert (per_request.size() == req["preemptions"].reindex(per_request.size().index) + 1).all(), strategy
        assert (t["end"] == "preempted").sum() == req["preemptions"].sum(), strategy
        last = per_request.last()
        assert (last["end"] == "finished").all() and (last["slot"] == req.loc[last.index, "slot"]).all(), strategy
    if run_name == "preempting":
        assert run.requests["inflight"]["preemptions"].sum() > 0  # the case this run exists for
    if run_name == "beams":
        assert (run.slots["inflight"]["width"] == 3).all()


@pytest.mark.parametrize("run_name", ["preempting", "cpu"])
def test_a_buffer_set_holds_one_step_at_a_time(runs, run_name):
    """Overlap alternates two sets, and never fills a set whose step's outputs are still unread."""
    run = runs[run_name]
    for strategy, it in run.iterations.items():
        sets = sorted(it["buffer_set"].unique())
        assert sets == ([0, 1] if strategy == "overlap" else [0] if strategy != "pipeline" else sets), strategy
        for k, g in it.groupby("buffer_set"):
            g = g.sort_values("prepare_start_s")
            held_to = g["postprocess_end_s"].to_numpy()
            assert (g["prepare_start_s"].to_numpy()[1:] >= held_to[:-1]).all(), (strategy, k)
    ov = run.iterations["overlap"]
    # and its two sets are in use at once: the next step is prepared before the last one's outputs are read
    assert (ov["prepare_start_s"].to_numpy()[1:] < ov["postprocess_start_s"].to_numpy()[:-1]).mean() > 0.5


def test_slot_figure_windows_long_runs_and_keeps_every_tenure_in_view(runs, monkeypatch):
    run = runs["preempting"]
    n = len(run.iterations["inflight"])
    fig = buffers.slot_occupancy(run)
    assert "Slot occupancy: which request holds each slot" in fig.layout.title.text
    total = sum(len(tr.x) for tr in fig.data if tr.type == "bar" and tr.xaxis in ("x2",))  # the inflight panel
    assert total >= len(run.slots["inflight"])  # each tenure drawn (prefill and decode parts)
    monkeypatch.setattr(buffers, "SLOT_ITERATIONS", n // 4)
    fig = buffers.slot_occupancy(run)
    title = next(a.text for a in fig.layout.annotations if a.text.startswith("inflight"))
    assert "window" in title and f"of {n}" in title
    a = n // 2 - n // 8
    for tr in fig.data:
        if tr.type == "bar" and tr.xaxis == "x2":
            assert (np.asarray(tr.base) >= a - 0.5).all() and (np.asarray(tr.base) + np.asarray(tr.x)
                                                               <= a + n // 4 + 0.5).all()


def test_slot_figure_draws_each_tenure_in_one_of_the_request_colours(runs):
    """Colours are numbers on a colour scale (one array for plotly to check): each bar's number falls inside
    one colour's flat step of the scale, so the browser draws exactly that colour, never a blend, and a
    slot's successive tenures differ."""
    run = runs["preempting"]
    fig = buffers.slot_occupancy(run)
    bars = [tr for tr in fig.data if tr.type == "bar"]
    scale = [(float(x), c) for x, c in bars[0].marker.colorscale]
    lo, hi = bars[0].marker.cmin, bars[0].marker.cmax

    def drawn(v: float) -> str:  # plotly.js interpolates linearly between the scale's neighbouring points
        x = (v - lo) / (hi - lo)
        (_, c0), (_, c1) = next((a, b) for a, b in itertools.pairwise(scale) if a[0] <= x <= b[0])
        assert c0 == c1, f"colour {v} blends {c0} and {c1}"
        return c0

    colours = {drawn(v) for tr in bars for v in tr.marker.color}
    assert colours == set(buffers.REQUEST_COLORS)  # the run has more tenures than colours
    decode = [tr for tr in bars if tr.name == "decode" and tr.xaxis == "x2"]
    by_slot = pd.DataFrame({"slot": np.concatenate([tr.y for tr in decode]),
                            "base": np.concatenate([tr.base for tr in decode]),
                            "colour": [drawn(v) for tr in decode for v in tr.marker.color]}).sort_values("base")
    for _, g in by_slot.groupby("slot"):
        assert (g["colour"].to_numpy()[1:] != g["colour"].to_numpy()[:-1]).all()


def test_buffer_fill_averages_long_runs_and_says_so(runs, monkeypatch):
    run = runs["preempting"]
    monkeypatch.setattr(buffers, "FILL_POINTS", 50)
    fig = buffers.buffer_fill([run], {})
    assert "mean of each" in fig.layout.title.text
    assert all(len(tr.x) <= 50 for tr in fig.data)
    it = run.iterations["inflight"]
    tokens = next(tr for tr in fig.data if tr.name == "inflight" and tr.yaxis == "y")
    k = -(-len(it) // 50)
    assert tokens.y[0] == pytest.approx(it["num_tokens"].iloc[:k].mean())  # a bin's mean, from the records


@pytest.mark.parametrize("figure", ["iteration_gantt", "buffer_sets"])
def test_timelines_of_strategies_share_one_time_scale(runs, figure):
    """Each panel spans the same milliseconds, wide enough for the longest strategy's window."""
    from reports import figures

    fig = getattr(figures if figure == "iteration_gantt" else buffers, figure)(runs["cpu"])
    axes = [fig.layout[k] for k in fig.layout if k.startswith("xaxis")]
    assert len(axes) == 3 and len({tuple(a.range) for a in axes}) == 1
    ends = [float(np.max(np.asarray(tr.base, float) + np.asarray(tr.x, float))) for tr in fig.data if len(tr.x)]
    assert max(ends) <= axes[0].range[1] and max(ends) >= 0.9 * axes[0].range[1]


def test_a_fleets_buffer_sets_have_a_lane_group_per_worker(tmp_path):
    """Disagg's workers are engines of their own, each with its buffer set 0: one lane each, named by worker,
    where they all shared one lane; each lane's steps are that worker's, from the records."""
    out = tmp_path / "d"
    p = cli("run", "--device", "sim", "--model-spec", "tiny", "--strategies", "disagg", "--num-decode-workers", "2",
            "--num-prompts", "30", "--request-rate", "50", "--input-len", "32", "--output-len", "16", "--warmup", "0",
            "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    from reports.figures import GANTT_ITERATIONS, middle_window

    run = load_run(out)
    fig = buffers.buffer_sets(run)
    device = next(tr for tr in fig.data if tr.name == "device runs the step")
    it = run.iterations["disagg"]
    a, b = middle_window(len(it), GANTT_ITERATIONS)
    window = it.iloc[a:b]
    assert window["worker"].nunique() >= 2
    assert sorted(device.y) == sorted(f"{w} set 0" for w in window["worker"])  # a step's lane is its worker's
