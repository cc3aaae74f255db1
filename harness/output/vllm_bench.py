"""``<strategy>/vllm_bench.json``: a strategy's run in the format of ``vllm bench serve --save-result
--save-detailed``, so that tools written for vLLM's result files read slotbench's, and a benchmark of a
real vLLM server sits beside slotbench's strategies in one report (``reports/vllm_result.py`` reads them).

vLLM's key names and units: per-request lists in seconds (``ttfts``, ``itls`` as a list per request,
``latencies``, ``start_times``), token counts (``input_lens``, ``output_lens``), aggregates in ms
(``mean_ttft_ms``, ``p99_itl_ms`` …) and per second. A request slotbench rejected or that failed is a
failed request there (``errors`` holds the reason; its ttft and latency are 0, as vLLM records them).
``duration`` is slotbench's ``duration_s`` (first arrival to last finish); ``start_times`` are run-clock
arrivals.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd

from reports.token_times import TokenTimes

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def vllm_result(strategy: str, model: str, requests: pd.DataFrame, token_times: TokenTimes,
                summary_row: dict, options: dict) -> dict:
    """The result dict ``vllm bench serve --save-result --save-detailed`` writes, for one strategy
    (``token_times``: of ``requests``' rows, in row order)."""
    ok = (requests["status"] == "finished").to_numpy()
    arrival = requests["arrival_s"].to_numpy(float)
    first = requests["first_token_s"].to_numpy(float)
    finish = requests["finish_s"].to_numpy(float)
    # each request's gaps, one per streamed chunk as vLLM records them, as arrays (orjson writes float64 arrays
    # as it writes floats: the same text, without 2.5M Python floats made for a 10,000-request run)
    per_request = token_times.chunk_gaps_per_request()  # [R] arrays
    itls = [g if good else [] for g, good in zip(per_request, ok.tolist(), strict=True)]
    rate = options.get("request_rate", math.inf)
    out: dict = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": "slotbench", "backend": "slotbench",
        "label": strategy, "model_id": model, "tokenizer_id": model, "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": options.get("burstiness", 1.0),
        "max_concurrency": options.get("max_concurrency"),
    }
    if options.get("ramp_up_strategy"):
        out.update({k: options[k] for k in ("ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps")})
    out.update({
        "duration": summary_row["duration_s"], "completed": int(ok.sum()), "failed": int((~ok).sum()),
        "total_input_tokens": summary_row["total_input_tokens"],
        "total_output_tokens": summary_row["total_output_tokens"],
        "request_throughput": summary_row["request_throughput"],
        "request_goodput": summary_row.get("request_goodput"),  # None without --goodput, as vLLM writes it
        "output_throughput": summary_row["output_throughput"],
        "total_token_throughput": summary_row["total_token_throughput"],
        "input_lens": requests["input_tokens"].astype(int).tolist(),
        "output_lens": np.where(ok, requests["output_tokens"], 0).astype(int).tolist(),
        "ttfts": np.where(ok, first - arrival, 0.0).tolist(),
        "itls": itls,
        "latencies": np.where(ok, finish - arrival, 0.0).tolist(),
        "start_times": arrival.tolist(),
        "generated_texts": [""] * len(requests),  # slotbench has token ids, not text
        "errors": ["" if good else str(reason) for good, reason in zip(ok, requests["finish_reason"], strict=True)],
    })
    out.update(_peaks(arrival[ok], finish[ok], token_times.chunk_times(ok)))
    for metric in LATENCY_METRICS:
        for stat in ("mean", "median", "std"):
            out[f"{stat}_{metric}_ms"] = summary_row.get(f"{stat}_{metric}_ms")
        for key, value in summary_row.items():
            if key.startswith("p") and key.endswith(f"_{metric}_ms"):
                out[key] = value
    return out


def _peaks(start: np.ndarray, end: np.ndarray, chunks: np.ndarray) -> dict:
    """``max_output_tokens_per_s`` and ``max_concurrent_requests`` as ``vllm bench serve`` computes them
    (vllm/benchmarks/serve.py, ``calculate_metrics``), over the finished requests: one-second buckets from the
    first start to the last end; a bucket counts one token per streamed chunk time in it (``chunks``: its
    ``ttft`` plus its ``itls``, so a chunk of several tokens counts once), and every request active at any moment
    of that second (from the second of its start to the second of its end, both included). Each is the busiest
    bucket's count, taken separately."""
    if len(start) == 0:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = float(start.min())
    n = math.ceil(float(end.max()) - t0) + 1  # buckets
    second = (chunks - t0).astype(np.int64)  # [C] truncation, as int() does for these non-negative offsets
    tokens = np.bincount(second[(second >= 0) & (second < n)], minlength=n)  # [n]
    active = np.zeros(n + 1, dtype=np.int64)  # [n + 1] +1 at each request's first second, -1 after its last
    np.add.at(active, (start - t0).astype(np.int64), 1)
    np.add.at(active, (end - t0).astype(np.int64) + 1, -1)
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(np.cumsum(active).max())}
