"""inference-perf's stages and client, as a replay follows them: a stage starts once the one before has drained
(``harness/traces/stage_drain.py``), and aiohttp ends a long time-out on a whole second (``harness/source.py``).

The expected values are worked from inference-perf's load generator (``load_generator.py: run_stage`` and
``run``: ``start_time = perf_counter() + 1``, a check of the finished count each second, then ``sleep(interval)``)
and aiohttp's ``helpers.TimeoutHandle.start`` (``when = ceil(loop.time() + timeout)`` for a time-out of 5 s or
more), not from this repository's code."""

import json

import numpy as np
import pandas as pd
import pytest

from harness.source import TraceSource, client_deadline
from harness.traces.stage_drain import StageDrain
from harness.traces.workload import load_workload
from harness.traces.workload_trace import workload_trace
from strategies.runtime.request import Request, Status
from tests.util import cli


def test_the_next_stage_starts_after_the_check_that_saw_the_last_request_end():
    # multi-process loop: stage 0's clock starts at 0, so its checks run at -1, 0, 1, ...; the last request ended at
    # 12.3, the check at 13 sees it, interval 1 s, and the next stage's clock starts 1 s after it begins
    multi = StageDrain((0.0, 10.0), interval_s=1.0)
    assert multi.next_origin(0.0, 12.3) == 15.0
    assert multi.next_origin(0.0, 13.0) == 15.0  # a check at the very end sees it
    assert multi.next_origin(0.0, None) == 1.0  # no requests: the first check (at -1) closes it
    assert StageDrain((0.0, 10.0), interval_s=0.0).next_origin(0.0, 12.3) == 14.0  # interval 0: no sleep
    # single-process loop: it waits for the last task itself, then the interval; no lead
    single = StageDrain.of_loop((0.0, 10.0), 1.0, multi_process=False)
    assert single.next_origin(0.0, 12.3) == pytest.approx(13.3)


def _requests(arrivals, stages):
    return [Request(str(i), np.arange(8), 4, arrival_s=a, stage=s)
            for i, (a, s) in enumerate(zip(arrivals, stages, strict=True))]


def test_a_stage_is_held_until_the_one_before_has_ended_and_keeps_its_gaps():
    reqs = _requests([0.5, 1.0, 2.0, 2.5, 3.5], [0, 0, 1, 1, 1])  # stage 1 drawn from 2.0 (nominal)
    src = TraceSource(reqs, stage_drain=StageDrain((0.0, 2.0), interval_s=1.0))
    assert [r.request_id for r in src.poll(5.0)] == ["0", "1"]  # stage 1 is due, but held
    assert src.next_arrival_s() is None  # nothing more arrives until stage 0 has ended
    reqs[0].end(Status.FAILED, "x", 3.0)
    src.on_finished(reqs[0])
    assert src.poll(6.0) == [] and src.next_arrival_s() is None
    reqs[1].end(Status.FAILED, "x", 6.2)  # the last end: checked at 7 (from -1), sleep 1, clock starts 1 s later
    src.on_finished(reqs[1])
    assert src.stage_origins == [0.0, 9.0]
    assert [r.arrival_s for r in reqs[2:]] == [9.0, 9.5, 10.5]  # moved by 7 s, gaps kept
    assert src.next_arrival_s() == 9.0 and [r.request_id for r in src.poll(9.6)] == ["2", "3"]


def test_aiohttp_ends_a_long_time_out_on_a_whole_second():
    # the measured reasoning run's time-outs took 300.0-301.0 s: a 300 s deadline rounded up to a whole second
    assert client_deadline(12.25, 300.0) == 313.0
    assert client_deadline(12.0, 300.0) == 312.0
    assert client_deadline(12.25, 5.0) == 18.0  # from the threshold on
    assert client_deadline(12.25, 1.5) == 13.75  # shorter ones are not rounded


STAGED = """\
load:
  type: constant
  interval: 1.0
  stages:
  - {rate: 2, duration: 2}
  - {rate: 2, duration: 2}
api: {type: completion, streaming: true}
data:
  type: shared_prefix
  shared_prefix: {num_groups: 1, num_prompts_per_group: 4, system_prompt_len: 30, question_len: 30, output_len: 300}
"""


def test_a_replay_starts_a_stage_once_the_stage_before_has_drained(tmp_path):
    """End to end on sim: stage 0's four requests generate 300 tokens each, seconds past the stage's nominal end at
    2 s, and stage 1 is sent only after the check that saw the last of them end, its gaps as drawn."""
    path = tmp_path / "w.yaml"
    path.write_text(STAGED)
    out = tmp_path / "o"
    r = cli("run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-2-7b", "--workload-config", str(path),
            "--strategies", "inflight,overlap", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    drawn = workload_trace(load_workload(str(path)), str(path), seed=0, vocab_size=32000).requests
    nominal = np.array([q.arrival_s for q in drawn if q.stage == 1])
    for strategy in ("inflight", "overlap"):
        df = pd.read_parquet(out / strategy / "requests.parquet")
        first, second = df[df["stage"] == 0], df[df["stage"] == 1]
        assert (first["status"] == "finished").all() and len(second) == 4
        last_end = float((first["arrival_s"] + first["e2el_ms"] / 1e3).max())
        assert last_end > 2.0 + 1.0  # the drain is real: seconds past the nominal start of stage 1
        origin = -1.0 + np.ceil(last_end + 1.0) + 1.0 + 1.0  # checks from -1 each second, interval 1, lead 1
        moved = np.sort(second["arrival_s"].to_numpy()) - (nominal - 2.0)
        assert np.allclose(moved, origin), strategy
        run = json.loads((out / "run.json").read_text())
        starts = next(s["stage_starts_s"] for s in run["strategies"] if s["name"] == strategy)
        assert starts == [0.0, pytest.approx(origin)] and run["trace"]["stages"][1]["start_s"] == 2.0  # as drawn
