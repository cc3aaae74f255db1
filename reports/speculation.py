"""Speculative decoding's figure: acceptance by draft position, and TPOT with and without speculation.

Read from documented columns only: iterations.parquet's ``spec_drafts`` and ``spec_accepted_by_position``
(vLLM's per-position acceptance: drafts accepted at position j over verifying steps), and summary.csv's
``median_tpot_ms`` / ``p99_tpot_ms``. A strategy whose iterations verified no draft is drawn as "without
speculation", so runs with and without ``--speculative-config`` in one report sit side by side.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from reports.figures import strategy_colors
from reports.run_data import RunData
from reports.subplots import Grid
from reports.tables import acceptance_by_position


def speculation(runs: list[RunData]) -> go.Figure | None:
    """None when no run speculated."""
    accepted = {(r.name, s): acceptance_by_position(it) for r in runs for s, it in r.iterations.items()}
    if not any(len(a) for a in accepted.values()):
        return None
    grid = Grid(1, 2, ["Acceptance by draft position (accepted / verifying steps)", "TPOT (ms), median and p99"])
    colors, multi = strategy_colors(runs), len(runs) > 1
    for key, a in accepted.items():
        if len(a):
            label = f"{key[0]} / {key[1]}" if multi else key[1]
            grid.add(go.Scatter(x=np.arange(1, len(a) + 1), y=a, mode="lines+markers", name=label,
                                line={"color": colors[key]}, legendgroup=label), 1, 1)
    labels, median, p99, bar_colors = [], [], [], []
    for r in runs:
        for _, row in r.summary.iterrows():
            key = (r.name, row["strategy"])
            with_spec = len(accepted.get(key, ())) > 0
            labels.append(f"{r.name} / {row['strategy']}" + (" (speculative)" if with_spec else " (without)"))
            median.append(row.get("median_tpot_ms", np.nan))
            p99.append(row.get("p99_tpot_ms", np.nan))
            bar_colors.append(colors.get(key, "#888"))
    grid.add(go.Bar(x=labels, y=median, name="median TPOT", marker={"color": bar_colors}, showlegend=False), 1, 2)
    grid.add(go.Scatter(x=labels, y=p99, mode="markers", name="p99 TPOT",
                        marker={"color": "#222", "symbol": "line-ew-open", "size": 18}), 1, 2)
    grid.xaxis(1, 1).update(title={"text": "draft position"}, dtick=1)
    grid.yaxis(1, 1)["range"] = [0, 1.02]
    return grid.figure("Speculative decoding", 440)
