"""One strategy's directory in a run: its records, Chrome trace, time slices and vLLM result file, and
its row of the run's summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import pandas as pd

from harness.metrics import engine_metrics, request_metrics
from harness.options import RunOptions
from harness.output.io import atomic_write_bytes, atomic_write_json, atomic_write_parquet, atomic_write_text
from harness.output.records import iterations_frame, read_tokens, requests_frame, slots_frame, tokens_jsonl
from harness.output.slices import slices_frame
from harness.output.timeline import chrome_trace
from harness.output.vllm_bench import vllm_result
from harness.runner import StrategyRun
from reports.run_data import StrategyFrames
from reports.token_times import TokenTimes

if TYPE_CHECKING:
    from harness.serve.spool import Spooled


def summary_row(run: StrategyRun, req_df: pd.DataFrame, it_df: pd.DataFrame, tokens: TokenTimes,
                opts: RunOptions) -> dict:
    # the resources a comparison is at: engines, and on the simulated device GPUs (--tp each)
    engines = (opts.num_prefill_workers + opts.num_decode_workers if run.name == "disagg"
               else opts.num_replicas if run.name == "inflight" else 1)
    row = {"strategy": run.name, "status": "ok" if run.error is None else "stopped", "error": run.error or "",
           "engines": engines,
           "gpus": engines * opts.tp * (opts.pp if run.name == "pipeline" else 1) if opts.device == "sim" else None}
    row.update(request_metrics(req_df, tokens, opts.percentiles, opts.goodput_slo))
    row.update(engine_metrics(it_df, opts.max_batch_size))
    row["wall_s"] = run.wall_s
    return row


def write_strategy(staging: Path, run: StrategyRun, opts: RunOptions) -> tuple[dict, StrategyFrames]:
    """Write ``run``'s files into ``staging/<strategy>/``; its summary row, and the frames written (for the
    run's report, which need not read them back)."""
    d = staging / run.name
    req_df = requests_frame(run.requests)
    it_df = iterations_frame(run.records)
    slots_df = slots_frame(run.tenures)
    tokens = {r.request_id: r.token_times_s for r in run.requests}
    token_lines = tokens_jsonl(run.requests)
    if run.spooled is not None:  # a server's: what it wrote away as it went, then what it still held
        req_df, it_df, slots_df, token_lines = _merge_spooled(run.spooled, req_df, it_df, slots_df, token_lines)
        tokens.update(read_tokens(run.spooled.tokens.decode()))
    flat = TokenTimes.of(tokens, req_df["request_id"])  # once, for the metrics, vLLM's file and the report
    atomic_write_parquet(d / "requests.parquet", req_df)
    atomic_write_parquet(d / "iterations.parquet", it_df)
    atomic_write_parquet(d / "slots.parquet", slots_df)
    atomic_write_bytes(d / "tokens.jsonl", token_lines)
    atomic_write_json(d / "timeline.json", chrome_trace(it_df, run.name), indent=None)
    if opts.slice_duration:
        slices = slices_frame(req_df, tokens, opts.slice_duration, tuple(dict.fromkeys((50, *opts.percentiles))))
        atomic_write_text(d / "slices.csv", slices.to_csv(index=False))
    if run.extras.get("server_metrics"):  # an endpoint run that read the server's /metrics (endpoint/scrape.py)
        atomic_write_parquet(d / "server_metrics.parquet", pd.DataFrame(run.extras["server_metrics"]))
    row = summary_row(run, req_df, it_df, flat, opts)
    if run.extras.get("client_us_per_request") is not None:
        row["client_us_per_request"] = run.extras["client_us_per_request"]
    model = opts.model_spec if opts.device == "sim" else opts.model
    result = vllm_result(run.name, model, req_df, flat, row, dataclasses.asdict(opts))
    atomic_write_json(d / "vllm_bench.json", result, indent=None)
    return row, StrategyFrames(req_df, it_df, slots_df, flat)


def _merge_spooled(s: Spooled, req_df: pd.DataFrame, it_df: pd.DataFrame, slots_df: pd.DataFrame,
                   token_lines: bytes) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, bytes]:
    """A server's records written away and those it still held, in a run's order: requests by arrival (tokens.jsonl
    in the same order), steps by schedule, slot tenures by first step within each worker. Empty frames are left out
    of each concatenation: their untyped columns would turn the others' ints to floats and floats to nulls."""

    def concat(a: pd.DataFrame, b: pd.DataFrame, by: list[str]) -> pd.DataFrame:
        parts = [f for f in (a, b) if len(f)]
        if len(parts) < 2:
            return parts[0] if parts else b
        return pd.concat(parts, ignore_index=True).sort_values(by, kind="stable").reset_index(drop=True)

    req_df = concat(s.requests, req_df, ["arrival_s"])
    it_df = concat(s.iterations, it_df, ["schedule_start_s"])
    slots_df = concat(s.slots.assign(_order=0), slots_df.assign(_order=0), ["_order"])
    workers = list(dict.fromkeys(slots_df["worker"].tolist()))  # (a fleet's workers in their order)
    slots_df = slots_df.assign(_order=slots_df["worker"].map(workers.index)).sort_values(
        ["_order", "start_iteration"], kind="stable").drop(columns="_order").reset_index(drop=True)
    lines = {orjson.loads(line)["request_id"]: line for line in (s.tokens + token_lines).splitlines()}
    token_lines = b"".join(lines[rid] + b"\n" for rid in req_df["request_id"].tolist() if rid in lines)
    return req_df, it_df, slots_df, token_lines
