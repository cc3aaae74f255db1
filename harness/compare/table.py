"""Predicted against measured: a run's figures per load stage beside a measured run's, with relative errors.

Reads documented frames only: requests.parquet's columns (``stage``, ``status``, ``ttft_ms``, ``e2el_ms``,
``output_tokens``) and the stages of run.json's trace (start_s, end_s). The predicted figures are computed
as ``harness/compare/measured.py`` defines the measured ones (same metrics, stats and TPOT rule), so each pair
is like for like. ``saturated_pct`` (predicted only): requests that did not finish or waited over 10 s for
their first token, in percent of those sent — what a client with a time-out would have seen fail.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.compare.measured import STATS, WHOLE_RUN

COMPARE_COLUMNS = ["stage", "metric", "stat", "predicted", "measured", "rel_error", "source"]
# the measured files' statistics (measured.STATS), computed here from each request's figure
STAT_OF = {"mean": np.mean, "median": np.median, "p90": lambda x: np.percentile(x, 90),
           "p99": lambda x: np.percentile(x, 99)}
assert tuple(STAT_OF) == STATS
SATURATED_TTFT_MS = 10_000.0


def stage_figures(requests: pd.DataFrame, duration_s: float, stage: int) -> list[dict]:
    """The figures of one stage's requests (all of them when ``stage`` is WHOLE_RUN)."""
    ok = requests[requests["status"] == "finished"]
    out: list[dict] = []
    if len(ok):
        for metric, col in (("ttft_ms", "ttft_ms"), ("e2el_ms", "e2el_ms")):
            values = ok[col].to_numpy(dtype=float)
            out += [{"stage": stage, "metric": metric, "stat": s, "value": float(f(values))}
                    for s, f in STAT_OF.items()]
        tokens = float(ok["output_tokens"].mean())
        if tokens > 1:
            tpot = (float(ok["e2el_ms"].mean()) - float(ok["ttft_ms"].mean())) / (tokens - 1)
            out.append({"stage": stage, "metric": "tpot_ms", "stat": "mean", "value": tpot})
    out += [{"stage": stage, "metric": "request_throughput", "stat": "value", "value": len(ok) / duration_s},
            {"stage": stage, "metric": "output_throughput", "stat": "value",
             "value": float(ok["output_tokens"].sum()) / duration_s}]
    sent = len(requests)
    if sent:
        slow = (requests["status"] != "finished") | ~(requests["ttft_ms"] <= SATURATED_TTFT_MS)
        out += [{"stage": stage, "metric": "failed_pct", "stat": "value",
                 "value": 100.0 * float((requests["status"] != "finished").sum()) / sent},
                {"stage": stage, "metric": "saturated_pct", "stat": "value", "value": 100.0 * float(slow.sum()) / sent}]
    return out


def predicted_figures(requests: pd.DataFrame, stages: list[dict]) -> pd.DataFrame:
    """Figures per stage (``stages``: run.json's trace stages; none: the whole run as one) and for the
    whole run (stage WHOLE_RUN)."""
    rows: list[dict] = []
    arrivals = requests["arrival_s"].to_numpy(dtype=float)
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    for k, st in enumerate(stages):
        rows += stage_figures(requests[requests["stage"] == k], st["end_s"] - st["start_s"], k)
    total = sum(st["end_s"] - st["start_s"] for st in stages) if stages else span
    rows += stage_figures(requests, total or 1.0, WHOLE_RUN)
    return pd.DataFrame(rows, columns=["stage", "metric", "stat", "value"])


def compare(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Each measured figure beside the predicted one of the same stage, metric and stat; rel_error =
    predicted / measured - 1 (NaN where the measured figure is 0)."""
    m = measured.rename(columns={"value": "measured"})
    p = predicted.rename(columns={"value": "predicted"})
    out = m.merge(p, on=["stage", "metric", "stat"], how="left")
    with np.errstate(divide="ignore", invalid="ignore"):
        out["rel_error"] = np.where(out["measured"] != 0, out["predicted"] / out["measured"] - 1, np.nan)
    keys = m[["source", "stage"]].drop_duplicates()  # each measured stage also shows the predicted saturation
    extra = keys.merge(p[p["metric"] == "saturated_pct"], on="stage").assign(measured=np.nan, rel_error=np.nan)
    out = pd.concat([out, extra], ignore_index=True)
    return out[COMPARE_COLUMNS].sort_values(["source", "stage", "metric"], kind="stable").reset_index(drop=True)
