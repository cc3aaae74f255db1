"""Summary tables: the metrics per strategy, and ratios against a baseline strategy."""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd

KEY_COLUMNS = ["run", "strategy", "completed", "rejected", "failed", "duration_s", "request_throughput",
               "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
               "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
               "p99_e2el_ms", "request_goodput", "mean_batch_size", "slot_occupancy", "padding_fraction",
               "device_busy_fraction", "host_ms_per_iteration", "preemptions", "prefix_cache_hit_rate",
               "kv_evictions"]

# What overlap can hide and what it did, beside what it bought (the report's "Host and device" table)
OVERLAP_COLUMNS = ["run", "strategy", "output_throughput", "host_ms_per_iteration", "device_ms_per_iteration",
                   "device_busy_fraction", "overlap_headroom", "host_hidden_fraction"]

# Direction of "better" for the ratio table: throughputs up, latencies down.
HIGHER_IS_BETTER = ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput")


def summary_table(summaries: list[tuple[str, pd.DataFrame]]) -> pd.DataFrame:
    frames = [df.assign(run=name) for name, df in summaries]
    df = pd.concat(frames, ignore_index=True)
    cols = [c for c in KEY_COLUMNS if c in df.columns]
    return df[cols + [c for c in df.columns if c not in cols]]


def ratio_table(summary: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Each strategy's metric divided by the baseline strategy's, within each run."""
    metrics = [c for c in summary.columns if c.endswith("_throughput") or c.endswith("_ms") or c == "request_goodput"]
    rows = []
    for run, group in summary.groupby("run", sort=False):
        base = group[group["strategy"] == baseline]
        if base.empty:
            continue
        b = base.iloc[0]
        for _, r in group.iterrows():
            rows.append({"run": run, "strategy": r["strategy"],
                         **{m: (r[m] / b[m] if b[m] else float("nan")) for m in metrics}})
    return pd.DataFrame(rows)


def format_number(v: object) -> str:
    """A number as a person reads it: thousands separated, never in exponent form; from 1,000 up one
    decimal (``1,718.5``), below that four significant digits (``45.34``, ``4.160``, ``0.07710``)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return "–" if math.isnan(v) else ("∞" if v > 0 else "-∞")
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.1f}"
    decimals = 3 - math.floor(math.log10(abs(v)))  # four significant digits
    text = f"{v:.{decimals}f}"
    return text if abs(float(text)) < 1000 else f"{v:,.1f}"  # 999.96 rounds up to 1,000.0


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """Every cell as ``format_number`` writes it (numpy scalars included)."""
    return df.map(lambda v: format_number(v.item() if hasattr(v, "item") else v))


def to_html_table(df: pd.DataFrame) -> str:
    """An escaped HTML table of ``readable`` cells (headers and labels are ours or escaped here)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = ["<tr>" + "".join(f"<td>{html.escape(text)}</td>" for text in row) + "</tr>"
            for row in readable(df).itertuples(index=False)]
    return f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def overlap_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Throughput beside host and device time per iteration, and how much of the host's time ran while the
    device was busy; empty for runs that predate these columns."""
    if "host_hidden_fraction" not in summary:
        return pd.DataFrame()
    return summary[[c for c in OVERLAP_COLUMNS if c in summary.columns]]


def acceptance_by_position(it: pd.DataFrame) -> np.ndarray:
    """Per draft position j, the share of verifying steps that accepted a draft there ([K], empty if none)."""
    if "spec_drafts" not in it or it["spec_drafts"].sum() == 0:
        return np.array([])
    rows = [np.asarray(x, dtype=float) for x in it["spec_accepted_by_position"] if len(x)]
    total = np.zeros(max(len(x) for x in rows))
    for x in rows:
        total[:len(x)] += x
    return total / it["spec_drafts"].sum()
