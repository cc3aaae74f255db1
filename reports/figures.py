"""Plotly figures from run data. Every series is aggregated to a bounded number of points, so the
report's size does not grow with the number of requests or tokens."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.run_data import RunData
from reports.subplots import Grid

CDF_POINTS = 200
TIME_BINS = 100
GANTT_ITERATIONS = 24
SLICED = ("p50_ttft_ms", "requests_in_flight")  # over-time panels drawn from slices.csv
# over-time panels drawn from an external server's /metrics (run --endpoint --scrape-interval)
SERVER = (("Server: running requests", "running"), ("Server: waiting requests", "waiting"),
          ("Server: KV cache usage (0-1)", "kv_cache_usage"), ("Server: preemptions (cumulative)", "preemptions"))
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def middle_window(n: int, size: int) -> tuple[int, int]:
    """[a, b) of ``size`` positions from the middle of ``n`` (all of them when n <= size)."""
    if n <= size:
        return 0, n
    a = n // 2 - size // 2
    return a, a + size


def _label(run: RunData, strategy: str, multi: bool) -> str:
    return f"{run.name} / {strategy}" if multi else strategy


def strategy_colors(runs: list[RunData]) -> dict[tuple[str, str], str]:
    keys = [(r.name, s) for r in runs for s in r.summary["strategy"]]
    return {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(keys)}


def _iterations(runs: list[RunData]) -> Iterator[tuple[RunData, str, pd.DataFrame, np.ndarray, float]]:
    """(run, strategy, its iterations, step start times, last step end) for each strategy that ran."""
    for run in runs:
        for strategy, it in run.iterations.items():
            if not it.empty:
                yield (run, strategy, it, it["forward_start_s"].to_numpy(float),
                       float(np.nanmax(it["sample_end_s"].to_numpy(float))))


def _line(grid: Grid, x: np.ndarray, y: np.ndarray, run: RunData, strategy: str, color: str, multi: bool,
          row: int) -> None:
    """One strategy's line in panel ``row``; the legend names it once, in the first panel."""
    grid.add(go.Scatter(x=x, y=y, mode="lines", name=_label(run, strategy, multi),
                        legendgroup=f"{run.name}/{strategy}", showlegend=row == 1, line={"color": color}), row)


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return np.array([]), np.array([])
    q = np.linspace(0, 1, min(CDF_POINTS, len(values)))
    # the same order statistics from a sorted copy: 2.5M inter-token gaps took 0.15 s unsorted, 0.06 s so
    return np.quantile(np.sort(values), q), q


def latency_cdfs(runs: list[RunData]) -> go.Figure:
    metrics = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", None), ("E2EL", "e2el_ms")]
    grid = Grid(2, 2, [f"{m} CDF (ms)" for m, _ in metrics])
    colors, multi = strategy_colors(runs), len(runs) > 1
    for run in runs:
        for strategy, req in run.requests.items():
            done = req[req["status"] == "finished"]
            for i, (_, col) in enumerate(metrics):
                values = run.itl_ms.get(strategy, np.array([])) if col is None else done[col].to_numpy(float)
                x, y = _cdf(values)
                grid.add(go.Scatter(x=x, y=y, mode="lines", name=_label(run, strategy, multi),
                                    legendgroup=f"{run.name}/{strategy}", showlegend=i == 0,
                                    line={"color": colors[(run.name, strategy)]}), i // 2 + 1, i % 2 + 1)
    return grid.figure("Latency distributions", 650)


def _binned(t: np.ndarray, values: np.ndarray, t_max: float, how: str) -> tuple[np.ndarray, np.ndarray]:
    edges = np.linspace(0.0, max(t_max, 1e-9), TIME_BINS + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, TIME_BINS - 1)
    centers = (edges[:-1] + edges[1:]) / 2
    if how == "rate":
        return centers, np.bincount(idx, minlength=TIME_BINS) / (edges[1] - edges[0])
    sums = np.bincount(idx, weights=values, minlength=TIME_BINS)
    counts = np.bincount(idx, minlength=TIME_BINS)
    if how == "sum":  # the bins that hold any value, so two sums over the same times line up
        return centers[counts > 0], sums[counts > 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / counts
    keep = counts > 0
    return centers[keep], mean[keep]


def over_time(runs: list[RunData]) -> go.Figure:
    """Per-iteration series binned over the run; with --slice-duration, also each time slice's median
    TTFT and requests in flight (slices.csv: latency is known when a request ends, so by finish time)."""
    panels = [("Output throughput (tokens/s)", None), ("Batch size (rows per iteration)", "batch"),
              ("Active slots", "active_slots"), ("Waiting requests", "waiting_requests"),
              ("KV blocks in use", "kv_blocks_used")]
    if any(r.slices for r in runs):
        panels += [("Median TTFT per time slice (ms, requests ending in it)", "p50_ttft_ms"),
                   ("Requests in flight per time slice (mean)", "requests_in_flight")]
    if any(r.server for r in runs):
        panels += list(SERVER)
    grid = Grid(len(panels), titles=[p for p, _ in panels], shared_xaxes=True,
                vertical_spacing=0.05 if len(panels) <= 5 else 0.035)
    colors, multi = strategy_colors(runs), len(runs) > 1
    for run, strategy, it, t, t_max in _iterations(runs):
        tok = run.token_times.get(strategy, np.array([]))
        series = {"batch": (it["num_context_requests"] + it["num_generation_requests"]).to_numpy(float)}
        sl = run.slices.get(strategy)
        for i, (_, col) in enumerate(panels):
            if col is None:
                x, y = _binned(tok, tok, t_max, "rate")
            elif col in dict(SERVER).values():  # (drawn below, from a server's /metrics)
                continue
            elif col in SLICED:
                if sl is None or col not in sl:
                    continue
                x, y = ((sl["start_s"] + sl["end_s"]) / 2).to_numpy(float), sl[col].to_numpy(float)
            else:
                x, y = _binned(t, series[col] if col in series else it[col].to_numpy(float), t_max, "mean")
            _line(grid, x, y, run, strategy, colors[(run.name, strategy)], multi, i + 1)
    for run in runs:  # an external server's (run --endpoint): its throughput from the tokens, and its /metrics
        for strategy in run.requests:
            if strategy in run.iterations and not run.iterations[strategy].empty:
                continue
            tok, color = run.token_times.get(strategy, np.array([])), colors[(run.name, strategy)]
            if len(tok):
                _line(grid, *_binned(tok, tok, float(tok.max()), "rate"), run, strategy, color, multi, 1)
            scraped = run.server.get(strategy)
            for i, (_, col) in enumerate(panels):
                if scraped is not None and col in dict(SERVER).values() and col in scraped:
                    _line(grid, scraped["time_s"].to_numpy(float), scraped[col].to_numpy(float), run, strategy,
                          color, multi, i + 1)
    grid.xaxis(len(panels))["title"] = {"text": "run time (s)"}
    return grid.figure("Over time", 220 * len(panels))


def kv_cache(runs: list[RunData]) -> go.Figure:
    """Blocks held and cached-but-free over time, the prefix-cache hit rate of requests by arrival, and where a run
    has a host KV tier, the blocks it holds."""
    rows = list(_iterations(runs))
    host = any("host_kv_blocks_total" in it and it["host_kv_blocks_total"].any() for _, _, it, _, _ in rows)
    titles = ["KV blocks held by running requests", "KV blocks cached, free but reusable",
              "Prefix-cache hit rate (prompt tokens read from cache, requests by arrival)",
              *(["Host KV tier: blocks holding evicted keys"] if host else [])]
    grid = Grid(len(titles), titles=titles, shared_xaxes=True, vertical_spacing=0.08)
    colors, multi = strategy_colors(runs), len(runs) > 1
    panels = {1: "kv_blocks_used", 2: "kv_blocks_cached", **({4: "host_kv_blocks_used"} if host else {})}
    for run, strategy, it, t, t_max in rows:
        series = {row: _binned(t, it[c].to_numpy(float), t_max, "mean") for row, c in panels.items() if c in it}
        req = run.requests.get(strategy)
        if req is not None and "cached_tokens" in req:
            done = req[req["status"] == "finished"]
            arr = done["arrival_s"].to_numpy(float)
            cached = _binned(arr, done["cached_tokens"].to_numpy(float), t_max, "sum")
            prompt = _binned(arr, done["input_tokens"].to_numpy(float), t_max, "sum")
            with np.errstate(invalid="ignore", divide="ignore"):
                series[3] = (cached[0], cached[1] / prompt[1])
        for row, (x, y) in series.items():
            _line(grid, x, y, run, strategy, colors[(run.name, strategy)], multi, row)
    grid.yaxis(3)["range"] = [0, 1]
    grid.xaxis(len(titles))["title"] = {"text": "run time (s)"}
    return grid.figure("KV cache", 230 * len(titles) + 10)


def padding(runs: list[RunData]) -> go.Figure:
    labels, values = [], []
    for run in runs:
        for _, row in run.summary.iterrows():
            labels.append(_label(run, row["strategy"], len(runs) > 1))
            values.append(row.get("padding_fraction", np.nan))
    return go.Figure(go.Bar(x=labels, y=values, marker_color="#7f7f7f"),
                     {"title": {"text": "Padding fraction (tokens computed for nothing)"}, "yaxis": {"range": [0, 1]},
                      "height": 350})


def iteration_gantt(run: RunData) -> go.Figure:
    """Host and device phases of a window of iterations from the middle of each strategy's run."""
    strategies = [s for s, it in run.iterations.items() if not it.empty]
    grid = Grid(max(len(strategies), 1), titles=strategies or ["(no iterations)"], vertical_spacing=0.12)
    span = 0.0  # the widest window: every panel shares its time scale, so strategies compare by eye
    phase_colors = {"schedule": "#ff7f0e", "prepare": "#bcbd22", "postprocess": "#9467bd",
                    "encode": "#2ca02c", "forward": "#1f77b4", "sample": "#17becf"}
    for row, strategy in enumerate(strategies, start=1):
        it = run.iterations[strategy]
        window = it.iloc[slice(*middle_window(len(it), GANTT_ITERATIONS))]
        t0 = float(window["schedule_start_s"].min())
        for phase, color in phase_colors.items():
            if f"{phase}_start_s" not in window:  # a run recorded before the phase existed
                continue
            lane = "device" if phase in ("encode", "forward", "sample") else "host"
            start = (window[f"{phase}_start_s"] - t0) * 1e3
            dur = (window[f"{phase}_end_s"] - window[f"{phase}_start_s"]) * 1e3
            ok = start.notna() & dur.notna()
            grid.add(go.Bar(y=[lane] * int(ok.sum()), x=dur[ok], base=start[ok], orientation="h", name=phase,
                            marker_color=color, legendgroup=phase, showlegend=row == 1,
                            customdata=window["iteration"][ok],
                            hovertemplate=f"{phase} iteration %{{customdata}}<br>%{{base:.3f}} ms"
                                          "+%{x:.3f} ms<extra></extra>"), row)
        _stage_lanes(grid, window, t0, row)
        ends = window[[c for c in window if c.endswith("_end_s") and window[c].dtype.kind == "f"]]
        span = max(span, (float(np.nanmax(ends.to_numpy(float))) - t0) * 1e3)
    for axis in grid.xaxes():
        axis["range"] = [0, span * 1.02]
    grid.xaxis(max(len(strategies), 1))["title"] = {"text": "ms from window start"}
    return grid.figure(f"Iteration timeline ({run.name}): host vs device lanes, one time scale",
                       max(300, 220 * len(strategies)), barmode="overlay")


def _stage_lanes(grid: Grid, window: pd.DataFrame, t0: float, row: int) -> None:
    """Pipeline runs: a lane per stage process, each micro-batch its own colour."""
    if "stage_start_s" not in window:
        return
    window = window[[len(x) > 0 for x in window["stage_start_s"]]]  # a step never waited for has no times
    if window.empty:
        return
    start = np.vstack([np.asarray(x, float) for x in window["stage_start_s"]])  # [iterations, stages]
    end = np.vstack([np.asarray(x, float) for x in window["stage_end_s"]])
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
    for mb in sorted(set(window["micro_batch"])):
        pick = (window["micro_batch"] == mb).to_numpy()
        for stage in range(start.shape[1]):
            dur = (end[pick, stage] - start[pick, stage]) * 1e3
            grid.add(go.Bar(y=[f"stage {stage}"] * int(pick.sum()), x=dur,
                            base=(start[pick, stage] - t0) * 1e3, orientation="h", name=f"micro-batch {mb}",
                            marker_color=colors[int(mb) % len(colors)], legendgroup=f"mb{mb}",
                            showlegend=row == 1 and stage == 0, customdata=window["iteration"][pick],
                            hovertemplate=f"stage {stage}, micro-batch {mb}, iteration %{{customdata}}"
                                          "<br>%{base:.3f} ms +%{x:.3f} ms<extra></extra>"), row)


def sweep(runs: list[RunData]) -> go.Figure | None:
    """Latency percentiles and goodput against request rate, one line per strategy and per setting of
    the suite's other swept parameters (suites)."""
    rows = []
    for run in runs:
        rate = run.meta.get("options", {}).get("request_rate")
        if rate is None:
            continue
        others = ",".join(f"{k}={v}" for k, v in run.meta.get("suite_params", {}).items() if k != "request_rate")
        for _, s in run.summary.iterrows():
            rows.append({"rate": float(rate), **s.to_dict(),
                         "line": f"{s['strategy']} {others}" if others else str(s["strategy"])})
    df = pd.DataFrame(rows)
    if df.empty or df["rate"].nunique() < 2:
        return None
    df = df.replace([np.inf], np.nan).dropna(subset=["rate"]).sort_values("rate")
    panels = [("median_ttft_ms", "p99_ttft_ms", "TTFT (ms)"), ("median_tpot_ms", "p99_tpot_ms", "TPOT (ms)"),
              ("median_e2el_ms", "p99_e2el_ms", "E2EL (ms)"), ("output_throughput", None, "Output tokens/s"),
              ("request_goodput", None, "Goodput (req/s)")]
    grid = Grid(len(panels), titles=[p[2] for p in panels], vertical_spacing=0.05)
    for k, strategy in enumerate(df["line"].unique()):
        d = df[df["line"] == strategy]
        color = PALETTE[k % len(PALETTE)]
        for i, (p50, p99, _) in enumerate(panels):
            if p50 not in d:
                continue
            grid.add(go.Scatter(x=d["rate"], y=d[p50], mode="lines+markers", name=f"{strategy} p50"
                                if p99 else strategy, legendgroup=strategy, showlegend=i == 0,
                                line={"color": color}), i + 1)
            if p99:
                grid.add(go.Scatter(x=d["rate"], y=d[p99], mode="lines+markers", name=f"{strategy} p99",
                                    legendgroup=strategy, showlegend=i == 0,
                                    line={"color": color, "dash": "dash"}), i + 1)
    grid.xaxis(len(panels))["title"] = {"text": "request rate (req/s)"}
    return grid.figure("Throughput and latency against request rate", 260 * len(panels))


def repeats(stats: pd.DataFrame, metrics: tuple[str, ...]) -> go.Figure:
    """Each metric's mean per configuration and strategy, with its 95% confidence interval."""
    grid = Grid(1, len(metrics), list(metrics))
    for col, m in enumerate(metrics, start=1):
        for i, (strategy, group) in enumerate(stats.groupby("strategy", sort=False)):
            grid.add(go.Bar(x=group["config"], y=group[f"{m}_mean"], name=str(strategy),
                            marker_color=PALETTE[i % len(PALETTE)], legendgroup=str(strategy), showlegend=col == 1,
                            error_y={"type": "data", "array": group[f"{m}_ci95"], "visible": True}), 1, col)
    return grid.figure("Repeats: mean and 95% confidence interval", 420, barmode="group")
