"""Engine metrics of host/device overlap, against a brute-force count and against runs whose answer is known."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.metrics import engine_metrics, host_hidden_fraction
from harness.output.records import iterations_frame
from reports.token_times import TokenTimes
from strategies.config import ExecutorConfig
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, make_requests, run_strategy, tiny_models


def brute_hidden(it: pd.DataFrame) -> float:
    """The same share on a 1 µs grid: for every instant of host phase, is some device span running?"""
    grid = np.arange(0, 1.0, 1e-6)
    busy = np.zeros(len(grid), dtype=bool)
    for a, b in zip(it["forward_start_s"], it["sample_end_s"], strict=True):
        busy[(grid >= a) & (grid < b)] = True
    host = hidden = 0
    for phase in ("schedule", "prepare", "postprocess"):
        for a, b in zip(it[f"{phase}_start_s"], it[f"{phase}_end_s"], strict=True):
            inside = (grid >= a) & (grid < b)
            host += inside.sum()
            hidden += (inside & busy).sum()
    return hidden / host


@pytest.mark.parametrize("seed", range(5))
def test_host_hidden_fraction_against_a_brute_force_count(seed):
    rng = np.random.default_rng(seed)
    n = 12
    cols = {}
    for phase in ("schedule", "prepare", "postprocess", "forward", "sample"):
        a = rng.uniform(0, 0.9, n)
        cols[f"{phase}_start_s"], cols[f"{phase}_end_s"] = a, a + rng.uniform(0.001, 0.08, n)
    # device spans: forward start → sample end, overlapping one another as pipeline micro-batches do
    cols["sample_end_s"] = cols["forward_start_s"] + rng.uniform(0.001, 0.1, n)
    it = pd.DataFrame(cols)
    assert host_hidden_fraction(it, it["forward_start_s"]) == pytest.approx(brute_hidden(it), abs=2e-4)


def host_device_metrics(name: str) -> dict:
    reqs = make_requests([(list(range(1, 12 + i)), 24, SamplingParams(ignore_eos=True)) for i in range(8)])
    s = run_strategy(name, TINY64, tiny_models()[1], ExecutorConfig(max_batch_size=8, max_seq_len=64), reqs)
    return engine_metrics(iterations_frame(s.records), 8)


@pytest.mark.parametrize("name", ["static", "inflight"])
def test_a_loop_that_waits_for_every_step_hides_no_host_time(name):
    m = host_device_metrics(name)
    assert 0 < m["overlap_headroom"] < 1 and m["host_hidden_fraction"] == 0.0


@pytest.mark.serial  # the device must be running step n+1 while the host handles n: not on a loaded machine
def test_overlap_hides_host_time():
    """Overlap schedules step n+1 and postprocesses n while n+1 runs (seen: 0.2-0.9 of its host time)."""
    m = host_device_metrics("overlap")
    assert 0 < m["overlap_headroom"] < 1 and m["host_hidden_fraction"] > 0


def test_token_gaps_are_each_requests_own_gaps():
    """One diff over every request's times, cut at request boundaries: against a diff per request, with
    requests of no token, one token, and a request id with no times at all; and of a selection of them."""
    rng = np.random.default_rng(3)
    times = {f"r{i}": np.cumsum(rng.random(int(n))).tolist() for i, n in enumerate(rng.integers(0, 6, 40))}
    ids = [*times, "absent"]
    tt = TokenTimes.of(times, ids)
    per_request = [np.diff(np.asarray(times.get(r, ()), float)) for r in ids]
    assert tt.counts.tolist() == [len(times.get(r, ())) for r in ids]
    assert np.array_equal(tt.gaps(), np.concatenate(per_request))
    rows = rng.random(len(ids)) < 0.5
    kept = [i for i, keep in enumerate(rows) if keep]
    assert np.array_equal(tt.gaps(rows), np.concatenate([per_request[i] for i in kept]))
    assert tt.tokens(rows).tolist() == [t for i in kept for t in times.get(ids[i], ())]
    assert TokenTimes.of({}, ["a"]).gaps().shape == (0,) and TokenTimes.of({}, []).counts.shape == (0,)
