"""Time slices, as AIPerf's ``--slice-duration``: the run cut into equal windows of run-clock time, each
with its own metrics (``<strategy>/slices.csv``).

A window [start, end) holds: the requests that *finished* in it (their TTFT, TPOT and E2EL: a request's
latency is known when it ends), the output tokens the host received in it (throughput), the
inter-token gaps whose later token fell in it — tokens and gaps of finished requests, by the summary's
rule — and the requests in flight — the mean over the window of the requests that had arrived and not yet
ended (exact: each request's overlap with the window, divided by its length). A finished request ends at
its last token, a failed one when its failure was seen (``failed_s``), a rejected one at its arrival.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.metrics import percentile_name

SLICE_STATS = ("ttft", "tpot", "itl", "e2el")


def slices_frame(requests: pd.DataFrame, token_times: dict[str, list[float]], duration_s: float,
                 percentiles: tuple[float, ...] = (50, 90, 99)) -> pd.DataFrame:
    """One row per window of ``duration_s`` seconds from t = 0 until the last request ended."""
    if not duration_s > 0:
        raise ValueError(f"--slice-duration must be positive, got {duration_s}")
    ended = requests["finish_s"].to_numpy(float)  # a finished request ends at its last token,
    if "failed_s" in requests:  # a failed one when its failure was seen (runs written before: at arrival),
        ended = np.where(np.isnan(ended), requests["failed_s"].to_numpy(float), ended)
    ended = np.where(np.isnan(ended), requests["arrival_s"].to_numpy(float), ended)  # a rejected one at arrival
    last = float(np.nanmax(ended)) if len(ended) else 0.0
    n = max(1, int(np.ceil(last / duration_s - 1e-12)))
    edges = np.arange(n + 1) * duration_s
    done = requests[requests["status"] == "finished"]
    fin = done["finish_s"].to_numpy(float)
    ttft = ((done["first_token_s"] - done["arrival_s"]) * 1e3).to_numpy(float)
    e2el = ((done["finish_s"] - done["arrival_s"]) * 1e3).to_numpy(float)
    n_out = done["output_tokens"].to_numpy()
    tpot = np.where(n_out > 1, (e2el - ttft) / np.maximum(n_out - 1, 1), np.nan)
    # tokens and gaps of the finished requests, as the summary counts throughput and ITL
    times = [np.asarray(token_times.get(rid, ()), float) for rid in done["request_id"]]
    tok = np.concatenate(times) if times else np.array([])
    # ITL one gap per streamed chunk, as vLLM counts it: tokens a step handed out together share a time
    gap_end = np.concatenate([t[1:][np.diff(t) > 0] for t in times if len(t) > 1]) if times else np.array([])
    gaps = np.concatenate([d[d > 0] * 1e3 for t in times if len(t) > 1 for d in (np.diff(t),)]) if times \
        else np.array([])
    arrival = requests["arrival_s"].to_numpy(float)
    rows = []
    for k in range(n):
        a, b = edges[k], edges[k + 1]
        pick = (fin >= a) & (fin < b) if k < n - 1 else (fin >= a)
        row: dict[str, float | int] = {"slice": k, "start_s": a, "end_s": b, "completed": int(pick.sum())}
        row["output_tokens"] = int(((tok >= a) & (tok < b)).sum()) if k < n - 1 else int((tok >= a).sum())
        row["output_throughput"] = row["output_tokens"] / duration_s
        row["request_throughput"] = row["completed"] / duration_s
        row["requests_in_flight"] = float(np.clip(np.minimum(ended, b) - np.maximum(arrival, a), 0, None).sum()
                                          / duration_s)
        in_gap = (gap_end >= a) & (gap_end < b) if k < n - 1 else (gap_end >= a)
        for name, values in (("ttft", ttft[pick]), ("tpot", tpot[pick]), ("itl", gaps[in_gap]),
                             ("e2el", e2el[pick])):
            values = values[np.isfinite(values)]
            nan = float("nan")
            row[f"mean_{name}_ms"] = float(values.mean()) if len(values) else nan
            for p in percentiles:
                row[f"p{percentile_name(p)}_{name}_ms"] = float(np.percentile(values, p)) if len(values) else nan
        rows.append(row)
    return pd.DataFrame(rows)
