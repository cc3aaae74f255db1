"""inference-perf's load generator as a replay follows it: a stage starts once the one before has drained
(``harness/traces/stage_drain.py``), aiohttp ends a long time-out on a whole second (``harness/source.py``), and
its config's defaults and random lengths (``harness/traces/workload.py``).

The expected values are worked from inference-perf's load generator (``load_generator.py: run_stage`` and
``run``: ``start_time = perf_counter() + 1``, a check of the finished count each second, then ``sleep(interval)``)
and aiohttp's ``helpers.TimeoutHandle.start`` (``when = ceil(loop.time() + timeout)`` for a time-out of 5 s or
more), not from this repository's code."""

import json

import numpy as np
import pandas as pd
import pytest

from harness.errors import UserError
from harness.source import TraceSource, client_deadline
from harness.traces.stage_drain import StageDrain
from harness.traces.workload import load_workload
from harness.traces.workload_trace import workload_trace
from strategies.runtime.request import Request, Status
from tests.test_workload import SHARED_PREFIX
from tests.util import cli


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


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


def _staged(load: str, stages: list[tuple[float, float]], output_len: int) -> str:
    """A two-stage shared-prefix config: one group of 4 prompts, ``output_len`` tokens each."""
    rows = "".join(f"  - {{rate: {r}, duration: {d}}}\n" for r, d in stages)
    return (f"load:\n  type: {load}\n  interval: 1.0\n  stages:\n{rows}api: {{type: completion, streaming: true}}\n"
            "data:\n  type: shared_prefix\n  shared_prefix: {num_groups: 1, num_prompts_per_group: 4, "
            f"system_prompt_len: 30, question_len: 30, output_len: {output_len}}}\n")


STAGED = _staged("constant", [(2, 2), (2, 2)], 300)


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


def test_inference_perfs_defaults_and_its_random_generator_lengths(tmp_path):
    """As inference-perf's config reads them: ``server.ignore_eos`` left out is true (its ModelServerClientConfig
    default); ``load.interval`` and ``num_workers: 0`` (its single-process loop: no cap, only requests due before a
    stage's end) are honoured; a random distribution's ``total_count`` lengths are drawn once and request i of each
    stage takes the i-th (``get_request(n)`` indexes ``input_lengths[n]``), and too few of them is refused."""
    plain = SHARED_PREFIX.replace("  ignore_eos: true\n", "")
    w = load_workload(_write(tmp_path, "d.yaml", plain))
    assert w.ignore_eos and w.multi_process and w.interval_s == 1.0
    single = plain.replace("  type: constant\n", "  type: constant\n  interval: 2.5\n  num_workers: 0\n"
                           "  worker_max_concurrency: 100\n")
    w = load_workload(_write(tmp_path, "s.yaml", single))
    assert (w.interval_s, w.multi_process, w.max_concurrency) == (2.5, False, None)
    t = workload_trace(w, "s.yaml", seed=0, vocab_size=1000)
    assert t.stage_drain is not None and (t.stage_drain.interval_s, t.stage_drain.poll_s) == (2.5, 0.0)
    for k, (start, end, _rate) in enumerate(t.stages):  # its last request, due at the stage's end, is not sent
        assert all(start < r.arrival_s < end for r in t.requests if r.stage == k)
    assert len(t) < 4 * 10 + 10 * 5
    text = SHARED_PREFIX.split("data:")[0] + """\
data:
  type: random
  input_distribution: {min: 10, max: 500, mean: 200, std_dev: 100, total_count: 60}
  output_distribution: {min: 5, max: 90, mean: 40, std_dev: 20, total_count: 60}
"""
    t = workload_trace(load_workload(_write(tmp_path, "r.yaml", text)), "r.yaml", seed=1, vocab_size=1000)
    first = [(r.input_tokens, r.output_tokens) for r in t.requests if r.stage == 0]
    second = [(r.input_tokens, r.output_tokens) for r in t.requests if r.stage == 1]
    assert len(first) == 40 and len(second) == 50 and second[:40] == first and len(set(first)) > 30
    with pytest.raises(UserError, match="total_count 30 is fewer than a stage's 50 requests"):
        workload_trace(load_workload(_write(tmp_path, "f.yaml", text.replace("total_count: 60", "total_count: 30"))),
                       "f.yaml", seed=1, vocab_size=1000)


def test_a_client_gives_up_on_a_whole_second_of_its_clock():
    """Through the source: a request sent at 12.25 s with the 300 s time-out is given up at 313 s, not 312.25."""
    r = Request("0", np.arange(8), 4, arrival_s=12.25)
    aborted = []
    src = TraceSource([r], request_timeout_s=300.0, abort=lambda q, why: aborted.append((q.request_id, why)))
    assert src.poll(12.25) == [r] and src.next_arrival_s() == 313.0
    src.poll(312.9)
    assert not aborted
    src.poll(313.0)
    assert aborted == [("0", "timeout: no complete response 300 s after it was sent")]


POISSON = _staged("poisson", [(4, 10), (10, 5)], 30)


def test_poisson_stages_that_overrun_their_duration_replay_one_after_the_other(tmp_path):
    """A Poisson stage sends rate x duration requests whatever its per-second counts, so when they fall short its last
    requests are drawn past the next stage's nominal start (seed 3 here): the stages still run one after the other."""
    path = _write(tmp_path, "p.yaml", POISSON)
    drawn = workload_trace(load_workload(path), path, seed=3, vocab_size=32000).requests
    assert max(q.arrival_s for q in drawn if q.stage == 0) > min(q.arrival_s for q in drawn if q.stage == 1)
    out = tmp_path / "o"
    r = cli("run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-2-7b", "--workload-config", path,
            "--seed", "3", "--strategies", "overlap", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(out / "overlap" / "requests.parquet")
    first = df[df["stage"] == 0]
    assert len(first) == 40 and (df["stage"] == 1).sum() == 50 and (df["status"] == "finished").all()
    assert df.loc[df["stage"] == 1, "arrival_s"].min() > (first["arrival_s"] + first["e2el_ms"] / 1e3).max()


def test_a_stage_without_requests_is_refused_where_inference_perf_cannot_run_it(tmp_path):
    """Its multi-process loop divides its progress by the stage's request count (ZeroDivisionError); its
    single-process loop runs such a stage (none sent, then the interval)."""
    text = SHARED_PREFIX.replace("rate: 10\n    duration: 5", "rate: 0.05\n    duration: 10")
    with pytest.raises(UserError, match=r"load.stages\[1\] sends no request"):
        load_workload(_write(tmp_path, "z.yaml", text))
    single = text.replace("  type: constant\n", "  type: constant\n  num_workers: 0\n")
    t = workload_trace(load_workload(_write(tmp_path, "s.yaml", single)), "s.yaml", seed=0, vocab_size=1000)
    assert {q.stage for q in t.requests} == {0}


DUMPED_2026 = """\
api: {type: completion, streaming: true, headers: null, slo_unit: null, slo_tpot_header: null, slo_ttft_header: null}
data:
  type: shared_prefix
  path: null
  input_distribution: null
  output_distribution: null
  shared_prefix: {num_groups: 2, num_prompts_per_group: 3, system_prompt_len: 10, question_len: 20, output_len: 4,
                  question_distribution: null, output_distribution: null, enable_multi_turn_chat: false}
  trace: null
load:
  type: constant
  interval: 1.0
  stages:
  - {rate: 4.0, duration: 5, num_requests: null, concurrency_level: null}
  sweep: null
  num_workers: 4
  worker_max_concurrency: 100
  worker_max_tcp_connections: 2500
  trace: null
  circuit_breakers: []
  request_timeout: null
  lora_traffic_split: null
server: {type: vllm, model_name: m, base_url: 'http://127.0.0.1:8000', ignore_eos: true, api_key: null}
"""


def test_a_february_2026_dump_is_accepted_and_what_it_sets_is_refused(tmp_path):
    """inference-perf 4ad7d4b's config model dumps keys the measured runs' build had not (``Config.model_dump``: null
    SLO headers, data and load traces, LoRA splits, a rate stage's null request count, multi-turn off): they change
    nothing; set, each is refused by name."""
    w = load_workload(_write(tmp_path, "c.yaml", DUMPED_2026))
    assert (w.question.mean, w.output.mean, w.num_groups, len(w.stages)) == (20, 4, 2, 1)
    for old, new, message in (("num_requests: null", "num_requests: 9", r"stages\[0\].num_requests is set"),
                              ("  trace: null\nload", "  trace: {file: t}\nload", "data.trace is set"),
                              ("lora_traffic_split: null", "lora_traffic_split: [{name: a, split: 1}]",
                               "load.lora_traffic_split is set"),
                              ("enable_multi_turn_chat: false", "enable_multi_turn_chat: true",
                               "enable_multi_turn_chat is set")):
        with pytest.raises(UserError, match=message):
            load_workload(_write(tmp_path, "bad.yaml", DUMPED_2026.replace(old, new)))
