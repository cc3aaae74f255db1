"""A ``vllm bench serve --save-result`` file as a run of the report: a benchmark of a real vLLM server
beside slotbench's strategies.

The file's aggregates (vLLM's key names: ``request_throughput``, ``median_ttft_ms``, ``p99_itl_ms`` …)
become its summary row, named by its ``label`` (or ``backend``, or the file name). With
``--save-detailed`` it also holds per-request lists (``input_lens``, ``output_lens``, ``ttfts``,
``itls``, ``latencies``, ``start_times``, ``errors``; seconds), which become the requests and token
times of the latency and over-time figures. It has no iterations: the engine's figures leave it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from reports.run_data import RunData

# vLLM's aggregate keys that keep their name in slotbench's summary (the same definitions)
SAME_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput")


def is_vllm_result(path: Path) -> bool:
    return path.is_file() and path.suffix == ".json"


def load_vllm_result(path: Path, name: str | None = None) -> RunData:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or "duration" not in data or "request_throughput" not in data:
        raise ValueError(f"{path}: not a `vllm bench serve --save-result` file (no duration or request_throughput)")
    strategy = str(data.get("label") or data.get("backend") or data.get("endpoint_type") or path.stem)
    row = {"strategy": strategy, "status": "ok", "duration_s": data["duration"]}
    row.update({k: data[k] for k in SAME_KEYS if data.get(k) is not None})
    row.update({k: v for k, v in data.items() if k.endswith("_ms") and isinstance(v, int | float)})
    meta = {"source": "vllm bench serve", "file": str(path),
            **{k: v for k, v in data.items() if not isinstance(v, list)}}
    run = RunData(name or path.stem, path, meta, pd.DataFrame([row]))
    if all(k in data for k in ("input_lens", "output_lens", "ttfts", "latencies", "start_times")):
        run.requests[strategy], times = _requests(data)
        done = run.requests[strategy]["status"] == "finished"
        run.token_times[strategy] = np.concatenate(times) if times else np.array([])
        gaps = [np.asarray(x, float) * 1e3 for x, ok in zip(data.get("itls", []), done, strict=False) if ok]
        run.itl_ms[strategy] = np.concatenate(gaps) if gaps else np.array([])
    run.iterations[strategy] = pd.DataFrame()
    return run


def _requests(data: dict) -> tuple[pd.DataFrame, list[np.ndarray]]:
    """requests.parquet's columns from vLLM's per-request lists (times from the first request's start),
    and each finished request's token times (first token, then its inter-token gaps added up)."""
    start = np.asarray(data["start_times"], float)
    t0 = float(start.min()) if len(start) else 0.0
    errors = data.get("errors") or [""] * len(start)
    itls = data.get("itls") or [[] for _ in start]
    ok = np.array([not e for e in errors]) & (np.asarray(data["latencies"], float) > 0)
    arrival = start - t0
    first = np.where(ok, arrival + np.asarray(data["ttfts"], float), np.nan)
    finish = np.where(ok, arrival + np.asarray(data["latencies"], float), np.nan)
    n_out = np.asarray(data["output_lens"], int)
    times = [f + np.concatenate([[0.0], np.cumsum(np.asarray(g, float))]) for f, g, good in zip(first, itls, ok,
                                                                                                   strict=True) if good]
    ttft, e2el = (first - arrival) * 1e3, (finish - arrival) * 1e3
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out > 1, (e2el - ttft) / (n_out - 1), np.nan)
    df = pd.DataFrame({"request_id": [str(i) for i in range(len(start))], "arrival_s": arrival,
                       "input_tokens": np.asarray(data["input_lens"], int), "output_tokens": n_out,
                       "status": np.where(ok, "finished", "failed"), "finish_reason": [str(e or "") for e in errors],
                       "first_token_s": first, "finish_s": finish, "slot": -1, "preemptions": 0,
                       "cached_tokens": 0, "ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el})
    return df, times
