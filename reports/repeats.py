"""Repeated runs: each metric's mean, 95% confidence interval (Student t) and coefficient of variation.

Reads a suite's summary rows with a ``config`` column (the configuration, repeats stripped) and a
``repeat`` column; any other numeric column is a metric.
"""

from __future__ import annotations

import math

import pandas as pd

# Two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1..30 (any table of the t distribution).
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
KEYS = ("run", "config", "repeat", "seed", "strategy")


def t975(df: int) -> float:
    """t_{0.975, df}; beyond the table, the normal quantile with two Cornish-Fisher terms (< 1e-4 off)."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def repeat_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (config, strategy): n, and per metric ``<m>_mean``, ``<m>_ci95`` (half-width of the
    95% interval of the mean) and ``<m>_cv`` (standard deviation / mean)."""
    if summary.empty or "config" not in summary or "repeat" not in summary:
        return pd.DataFrame()
    metrics = [c for c in summary.columns if c not in KEYS and pd.api.types.is_numeric_dtype(summary[c])
               and summary[c].notna().any()]
    rows = []
    for (config, strategy), group in summary.groupby(["config", "strategy"], sort=False):
        n = len(group)
        row: dict = {"config": config, "strategy": strategy, "repeats": n}
        for m in metrics:
            values = group[m].dropna()
            mean = values.mean() if len(values) else math.nan
            sd = values.std(ddof=1) if len(values) > 1 else math.nan
            row[f"{m}_mean"] = mean
            row[f"{m}_ci95"] = t975(len(values) - 1) * sd / math.sqrt(len(values)) if len(values) > 1 else math.nan
            row[f"{m}_cv"] = sd / mean if mean else math.nan
        rows.append(row)
    return pd.DataFrame(rows)
