"""The capacity search's figure: throughput per GPU against speed per user, with the Pareto frontier."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.figures import PALETTE


def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both x and y (higher is better), by x."""
    order = np.lexsort((-y, -x))  # by x descending, ties by y descending
    front, best_y = [], -np.inf
    for i in order:
        if y[i] > best_y:
            front.append(i)
            best_y = y[i]
    return np.array(front[::-1], dtype=int)


def capacity_pareto(points: pd.DataFrame) -> go.Figure:
    """Output tokens/s per GPU against tokens/s per user for every evaluated rate that met the SLOs,
    per configuration, with the frontier over all of them."""
    fig = go.Figure()
    ok = points[points["meets"].astype(bool)].dropna(subset=["tok_s_per_user", "output_tok_s_per_gpu"]) \
        if len(points) else points
    for i, (config, group) in enumerate(ok.groupby("config", sort=False) if len(ok) else []):
        fig.add_trace(go.Scatter(x=group["tok_s_per_user"], y=group["output_tok_s_per_gpu"], mode="markers",
                                 name=str(config), marker={"color": PALETTE[i % len(PALETTE)], "size": 8},
                                 customdata=group["request_rate"],
                                 hovertemplate="%{customdata:.3g} req/s<br>%{x:.1f} tok/s/user<br>"
                                               "%{y:.1f} tok/s/GPU<extra></extra>"))
    if len(ok):
        front = ok.iloc[pareto_front(ok["tok_s_per_user"].to_numpy(float), ok["output_tok_s_per_gpu"].to_numpy(float))]
        fig.add_trace(go.Scatter(x=front["tok_s_per_user"], y=front["output_tok_s_per_gpu"], mode="lines",
                                 name="Pareto frontier", line={"color": "#222", "dash": "dash"}))
    fig.update_layout(title="Capacity: throughput per GPU against speed per user (SLO met)",
                      xaxis_title="output tokens/s per user (1 / median TPOT)",
                      yaxis_title="output tokens/s per GPU", height=460)
    return fig
