"""Pipeline parallelism: stage processes on torch.distributed (gloo), micro-batches of disjoint requests.

Tokens are held to the in-flight strategy's (same model, float64): greedy and seeded sampling, with
chunked prefill and preemption. One pipeline executor (two stage processes) serves every generated
example in turn, so the processes start once.
"""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.metrics import pipeline_bubble_fraction
from harness.output.records import iterations_frame
from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.pipeline.messages import DIE, HANG
from strategies.runtime.request import Status
from strategies.runtime.sampling_params import SamplingParams
from tests.util import (
    TINY64,
    ListSource,
    assert_accounted,
    child_pids,
    make_requests,
    run_strategy,
    still_alive,
    tiny_models,
    wait_for_progress,
)

pytestmark = pytest.mark.xdist_group("pipeline")  # one worker: its module fixture is built once

# Chunked prefill (32-token budget), preemption (max-utilization, 14 blocks of 8 tokens), prefix caching.
CONFIG = ExecutorConfig(max_batch_size=6, max_seq_len=96, max_num_tokens=32, tokens_per_block=8, kv_blocks=14,
                        capacity_policy="max-utilization", chunked_prefill=True, prefix_caching=True,
                        pipeline_stages=2)


@pytest.fixture(scope="module")
def pipeline():
    s = get_strategy("pipeline")(TINY64, tiny_models()[1], CONFIG)
    procs = s.engine.procs
    yield s
    s.close()
    assert not any(p.is_alive() for p in procs)


def _specs(rows, temperature, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 500, size=n).tolist(), out, SamplingParams(temperature=temperature, seed=seed + i))
            for i, (n, out) in enumerate(rows)]


def _serve(s, requests):
    s.run(ListSource(requests))
    assert_accounted(requests)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 24)), min_size=1, max_size=14),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_tokens_equal_inflight(pipeline, rows, temperature, seed):
    specs = _specs(rows, temperature, seed)
    reference = make_requests(specs)
    run_strategy("inflight", TINY64, tiny_models()[1], CONFIG, reference)
    got = make_requests(specs)
    _serve(pipeline, got)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in reference]
    assert [r.status for r in got] == [r.status for r in reference]


def test_a_busy_run_chunks_preempts_and_overlaps_stages(pipeline):
    """The fixed workload below exercises what the generated ones may miss — chunked prompts and
    preemption — and shows the pipeline pipelining: stage 0 computes one micro-batch while stage 1
    computes the other."""
    specs = _specs([(60, 20), (45, 24), (50, 16), (20, 24), (33, 20), (58, 12), (12, 24), (40, 18)], 0.0, 7)
    reference = make_requests(specs)
    run_strategy("inflight", TINY64, tiny_models()[1], CONFIG, reference)
    got = make_requests(specs)
    first = len(pipeline.records)
    _serve(pipeline, got)
    recs = pipeline.records[first:]
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in reference]
    assert any(r.preemptions for r in got)
    assert any(r.num_context_tokens and r.context_attention_pairs > r.num_context_tokens * (r.num_context_tokens + 1)
               // 2 for r in recs)  # a later chunk: it attends to an earlier one's pages
    assert {r.micro_batch for r in recs} == {0, 1}
    for r in recs:  # within a micro-batch the stages run in order
        assert r.stage_start_s[0] <= r.stage_end_s[0] <= r.stage_start_s[1] <= r.stage_end_s[1]
    # Two micro-batches in flight at once: k+1 is launched before k's tokens are read. (Whether the stages
    # then compute them at the same moment is the machine's business: tests/benchmarks/test_pipeline_bench.py.)
    in_flight_together = sum(b.launch_s < a.postprocess_start_s for a, b in itertools.pairwise(recs))
    assert in_flight_together >= len(recs) // 2
    bubble = pipeline_bubble_fraction(iterations_frame(recs))
    assert 0 < bubble < 1


def test_prefix_cache_hits_read_every_stages_cached_blocks(pipeline):
    """A prompt served once leaves its full blocks cached on every stage; a later prompt sharing its first
    40 tokens reads them instead of computing them, and its tokens still equal the in-flight strategy's."""
    first = _specs([(48, 6)], 0.0, 11)
    again = [([*first[0][0][:40], 7, 8, 9], 10, SamplingParams())]
    outputs = {}
    for name in ("inflight", "pipeline"):
        reqs = [make_requests(first), make_requests(again)]
        s = get_strategy("inflight")(TINY64, tiny_models()[1], CONFIG) if name == "inflight" else pipeline
        try:
            for batch in reqs:
                _serve(s, batch)
        finally:
            if s is not pipeline:
                s.close()
        assert reqs[1][0].cached_tokens == 40, name
        outputs[name] = [r.output_token_ids for batch in reqs for r in batch]
    assert outputs["pipeline"] == outputs["inflight"]


def test_micro_batches_hold_disjoint_requests(pipeline):
    """No scheduled request is in a micro-batch still in flight (TensorRT-LLM's inflight_req_ids)."""
    got = make_requests(_specs([(10, 12)] * 6, 0.0, 3))
    overlaps, in_flight_seen = [], []
    schedule = pipeline.scheduler.schedule

    def spy(iteration, running):
        batch = schedule(iteration, running)
        ids = {id(c.request) for c in batch.context} | {id(r) for r in batch.gen_requests}
        overlaps.append(ids & pipeline._in_flight)
        in_flight_seen.append(len(pipeline._in_flight))
        return batch

    pipeline.scheduler.schedule = spy
    try:
        _serve(pipeline, got)
    finally:
        del pipeline.scheduler.schedule
    assert max(in_flight_seen) > 0 and not any(overlaps)


@pytest.mark.parametrize("kind", [DIE, HANG])
def test_a_stage_that_dies_or_hangs_ends_the_run(kind):
    """A dead stage ends the run at once (its socket closes), long before the stage timeout; a silent one
    ends it once the timeout has passed."""
    from harness.runner import run_strategy as run

    timeout = 60.0 if kind == DIE else 3.0
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64, pipeline_stages=2, stage_timeout_s=timeout)
    requests = make_requests(_specs([(8, 30)] * 4, 0.0, 1))
    s = get_strategy("pipeline")(TINY64, tiny_models()[1], cfg)
    s.inject_stage_fault(1 if kind == DIE else 0, 5, kind)
    procs = s.engine.procs
    t = time.perf_counter()
    message = "pipeline stage 1 exited (code 3)" if kind == DIE else "did not answer within --stage-timeout (3 s)"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        s.run(ListSource(requests))
    took = time.perf_counter() - t
    s.close()
    assert not any(p.is_alive() for p in procs)
    if kind == DIE:
        assert took < timeout / 2, took  # not the timeout
    else:
        assert timeout <= took < timeout + 30
    assert len(s.records) >= 5  # what ran before the fault is kept
    # through the harness: unfinished requests end failed with the reason, nothing lost
    requests = make_requests(_specs([(8, 30)] * 4, 0.0, 1))
    result = run("pipeline", TINY64, tiny_models()[1], cfg, requests, fault_at_iteration=4)
    assert result.error and all(r.status is Status.FAILED for r in requests) and result.records


class _Proc:
    """A stage process's exit as the host sees it: alive until ``dies_at``, then exited with ``code``."""

    def __init__(self, code: int | None, dies_at: float) -> None:
        self.code, self.dies_at = code, dies_at

    def is_alive(self) -> bool:
        return time.monotonic() < self.dies_at

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else self.code


def test_a_lull_longer_than_the_stage_timeout_is_not_a_silent_stage():
    """The stages wait for the host's next step without --stage-timeout: with none, a run whose requests pause
    longer than it (a lull in a trace, an idle server) had every stage time out on the host, and the run fail."""
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64, pipeline_stages=2, stage_timeout_s=1.0)
    requests = make_requests(_specs([(8, 4)] * 2, 0.0, 1))
    requests[1].arrival_s = 3.0  # three times the stage timeout after the first
    s = get_strategy("pipeline")(TINY64, tiny_models()[1], cfg)
    try:
        s.run(ListSource(requests))
    finally:
        s.close()
    assert [r.status for r in requests] == [Status.FINISHED] * 2


def test_the_stage_that_failed_is_named_not_the_one_that_lost_it():
    """CI once reported 'stage 0 exited (code 1)' for stage 1's injected death: stage 0, whose socket to stage 1
    closed, exited and was seen before stage 1 was (a process's sockets close before its exit can be reaped).
    The casualty (its peer lost) is named only if no stage that failed on its own is seen within the grace."""
    from strategies.runtime.pipeline.stage_group import PipelineEngine
    from strategies.runtime.pipeline.stage_worker import PEER_LOST, PEER_SILENT

    now = time.monotonic()
    group = type("G", (), {"timeout_s": 3.0})()
    group.procs = [_Proc(PEER_LOST, now), _Proc(3, now + 0.2)]  # stage 0 seen dead first
    assert PipelineEngine.what_failed(group, False) == "pipeline stage 1 exited (code 3)"
    group.procs = [_Proc(PEER_LOST, now), _Proc(None, now + 60)]  # the cause never seen: the casualty named
    assert "stage 0 exited (code 2: a peer closed" in PipelineEngine.what_failed(group, False)
    assert "did not answer" in PipelineEngine.what_failed(group, True)
    # CI once reported 'stage 1 exited (code 2: a peer closed its connection)' for stage 0's injected hang: stage 1
    # timed out on it first (its receive has the same --stage-timeout) and exited, which the host saw before its own
    # time-out. A stage that exits for a silent peer says so, and the silence is what is reported.
    group.procs = [_Proc(None, now + 60), _Proc(PEER_SILENT, now)]
    assert "did not answer within --stage-timeout (3 s)" in PipelineEngine.what_failed(group, False)


def test_ctrl_c_stops_every_stage(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--model", "tiny", "--strategies", "pipeline",
                             "--num-prompts", "400", "--request-rate", "20", "--warmup", "0", "--out",
                             str(tmp_path / "r")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    stages = child_pids(proc, "spawn_main", 2)  # the stage processes: the CLI's spawned children
    assert len(stages) == 2
    wait_for_progress(proc, "pipeline", 5)  # serving
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err

    assert not still_alive(stages), f"stage processes left behind: {still_alive(stages)}"


def test_simulated_pipeline_bubbles_as_pipeline_theory_says(tmp_path):
    """Llama-3-70B in 4 simulated stages, at saturation: with one micro-batch a stage idles while the
    other three compute — a bubble of (N-1)/N = 0.75 — and with four the stages overlap (GPipe's bubble
    (N-1)/(M+N-1) for a batch of M is the bound for a single pass; continuous decoding refills it)."""
    from harness.app import execute
    from harness.options import RunOptions

    out = {}
    for m in (1, 4):
        opts = RunOptions(strategies=("pipeline",), device="sim", gpu="h100", model_spec="llama-3-70b", tp=4, pp=4,
                          num_micro_batches=m, num_prompts=200, request_rate=1000.0, input_len=512, output_len=64,
                          max_batch_size=256, max_seq_len=1024, max_num_tokens=8192, ignore_eos=True, warmup=0)
        run = execute(opts, tmp_path / f"m{m}", progress=False, report=False, log=lambda _: None)
        out[m] = run.summary.iloc[0].to_dict()
    assert abs(out[1]["pipeline_bubble_fraction"] - 0.75) < 0.05
    assert out[4]["pipeline_bubble_fraction"] < 0.4
    assert out[4]["output_throughput"] > 1.5 * out[1]["output_throughput"]
    # the timeline's stage lanes: each step's stage slices, in microseconds rounded as Python's round does
    it = pd.read_parquet(tmp_path / "m4" / "pipeline" / "iterations.parquet").set_index("iteration")
    events = json.loads((tmp_path / "m4" / "pipeline" / "timeline.json").read_text())["traceEvents"]
    stages = [e for e in events if e["ph"] == "X" and e["name"].startswith("stage ")]
    assert len(stages) == sum(map(len, it["stage_start_s"])) > len(it)
    for e in stages:
        s, row = int(e["name"].split()[1]), it.loc[e["args"]["iteration"]]
        start, end = row["stage_start_s"][s], row["stage_end_s"][s]
        assert (e["ts"], e["dur"], e["tid"]) == (round(start * 1e6, 3), round(max(end - start, 0.0) * 1e6, 3), 3 + s)
        assert e["args"]["micro_batch"] == row["micro_batch"]


def test_pipeline_on_cuda_is_refused_with_one_line(monkeypatch):
    """The stages run on gloo only: asked for CUDA (on a machine that has it), the options refuse at once
    instead of starting stage processes that would compute on the CPU."""
    import torch

    from harness.errors import UserError
    from harness.options import RunOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    RunOptions(strategies=("inflight",), device="cuda")  # CUDA itself passes the check here
    with pytest.raises(UserError, match="pipeline: the stage processes run on the CPU"):
        RunOptions(strategies=("inflight", "pipeline"), device="cuda:0")
