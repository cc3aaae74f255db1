"""A server's memory is bounded by what runs, not by what ran: what has ended is written away as it goes
(``harness/serve/spool.py``), and the run directory written at shutdown still holds every request, step and slot
tenure it served."""

from __future__ import annotations

import gc
import time
import weakref

import pandas as pd
import pytest

from harness.options import RunOptions
from harness.runner import build_requests
from harness.serve import spool
from harness.serve.engine import ServedEngine
from harness.traces.trace import TraceRequest


def _serve(n: int, tmp_path, strategy: str = "inflight", **kw):
    """``n`` requests through a served engine on the simulated device (no HTTP: its front end's calls), the engine
    stopped once every one has ended; (engine, run, weak references to the requests)."""
    opts = RunOptions(strategies=(strategy,), device="sim", model_spec="tiny", gpu="h100", max_batch_size=64,
                      max_num_tokens=512, warmup=0, seed=3, ignore_eos=True, **kw)
    engine = ServedEngine(opts, notify=lambda: None, spool_dir=tmp_path / "spool")
    requests = build_requests([TraceRequest(0.0, 16, 4)] * n, opts.sampling_defaults(), engine.model_cfg.vocab_size,
                              seed=1)
    refs = [weakref.ref(r) for r in requests]
    engine.start()
    for r in requests:
        engine.submit(r)
    del requests, r
    deadline = time.monotonic() + 120
    while engine.source.ended < n and engine.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.source.ended == n, engine.error
    return engine, engine.stop(), refs


def test_a_server_forgets_what_has_ended_and_its_run_directory_keeps_all(tmp_path, monkeypatch):
    monkeypatch.setattr(spool, "CHUNK", 64)
    monkeypatch.setattr("harness.serve.engine.CHUNK", 64)
    n = 400
    engine, run, refs = _serve(n, tmp_path)
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == len(run.requests) < 64 + 64  # what ended since the last part, and nothing else
    assert engine.spool.parts >= n // 64 - 1
    assert len(run.records) < len(run.spooled.iterations) // 2  # steps are written away too
    assert not (tmp_path / "spool").exists()  # read back and removed
    # every request, step and tenure is in what the run directory is written from, once
    from harness.output.strategy_dir import write_strategy

    write_strategy(tmp_path / "out", run, engine.run_options())
    d = tmp_path / "out" / "inflight"
    req = pd.read_parquet(d / "requests.parquet")
    it = pd.read_parquet(d / "iterations.parquet")
    slots = pd.read_parquet(d / "slots.parquet")
    assert len(req) == n and req["request_id"].is_unique and (req["status"] == "finished").all()
    assert req["arrival_s"].is_monotonic_increasing
    assert it["iteration"].is_unique and it["iteration"].is_monotonic_increasing
    assert it["iteration"].max() + 1 >= len(it) and it["num_samples"].sum() == req["output_tokens"].sum() == 4 * n
    assert len(slots) == n and set(slots["request_id"]) == set(req["request_id"])
    tokens = pd.read_json(d / "tokens.jsonl", lines=True)
    assert len(tokens) == n and (tokens["tokens"].map(len) == 4).all()
    assert len(engine.trace().requests) == n


@pytest.mark.parametrize("strategy", ["overlap", "disagg"])
def test_steps_in_flight_and_fleets_are_written_away_whole(tmp_path, monkeypatch, strategy):
    """Only steps that are done are written away (overlap holds one in flight while it schedules the next); a fleet
    hands over every worker's."""
    monkeypatch.setattr("harness.serve.engine.CHUNK", 32)
    n = 160
    engine, run, _ = _serve(n, tmp_path, strategy)
    assert engine.spool.parts >= 2
    it = pd.concat([run.spooled.iterations, pd.DataFrame({"postprocess_end_s": [r.postprocess_end_s
                                                                                for r in run.records]})])
    assert it["postprocess_end_s"].notna().all()
    assert len(run.spooled.requests) + len(run.requests) == n
    assert run.spooled.slots["worker"].ne("").all() if strategy == "disagg" else True


@pytest.mark.parametrize("written_away", ["nothing", "everything"])
def test_the_run_directory_has_the_runs_column_types_whatever_was_written_away(tmp_path, monkeypatch, written_away):
    """A server's requests.parquet and iterations.parquet have ``slotbench run``'s types (NaN-able floats stay floats,
    counts stay ints) whether none, or all, of what it served was written away before the end."""
    import pyarrow.parquet as pq

    from harness.output.strategy_dir import write_strategy

    monkeypatch.setattr("harness.serve.engine.CHUNK", 8 if written_away == "everything" else 10**9)
    engine, run, _ = _serve(16, tmp_path)
    assert (len(run.spooled.requests) > 0) == (written_away == "everything")
    write_strategy(tmp_path / "out", run, engine.run_options())
    d = tmp_path / "out" / "inflight"
    requests, iterations = pq.read_schema(d / "requests.parquet"), pq.read_schema(d / "iterations.parquet")
    for column in ("failed_s", "kv_ready_s", "prefill_first_token_s"):
        assert str(requests.field(column).type) == "double", column
    for column in ("num_tokens", "kv_blocks_used", "preemptions"):
        assert str(iterations.field(column).type) == "int64", column


def test_a_part_the_spool_cannot_write_stays_in_memory_whole(tmp_path, monkeypatch):
    """A full disk, say: the part is kept as it was handed over and goes into the run directory all the same."""
    import numpy as np

    from harness.serve.spool import Spool
    from strategies.runtime.request import Request

    spool = Spool(tmp_path / "s")
    calls = []

    def failing(requests):
        calls.append(len(requests))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("harness.serve.spool.tokens_jsonl", failing)
    r = Request("a", np.array([1, 2, 3]), 2)
    spool.put([r], [], [])
    s = spool.close()
    assert calls == [1] and s.unwritten[0] == [r] and "No space left" in s.error and len(s.requests) == 0
    assert not (tmp_path / "s").exists()


def test_the_newest_record_is_never_written_away():
    """The next launch still writes ``waited_before_next_launch`` into the newest record."""
    from strategies.runtime.iteration import IterationRecord, take_done

    records = [IterationRecord(i, postprocess_end_s=float(i)) for i in range(3)]
    taken = take_done(records)
    assert [r.iteration for r in taken] == [0, 1] and [r.iteration for r in records] == [2]
