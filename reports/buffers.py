"""Figures of the buffers themselves: who holds each request slot, which buffer set each step used and
when, and how full each step packed the runtime buffers. Long runs are cut to a window (slots, sets) or
averaged over bins of iterations (fill), and each figure says so in its title."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.figures import GANTT_ITERATIONS, middle_window
from reports.run_data import RunData
from reports.subplots import Grid

SLOT_ITERATIONS = 2000  # slot occupancy: at most this many iterations (a window from the run's middle)
FILL_POINTS = 2000  # buffer fill: past this many iterations, the mean of each bin of iterations
# Requests take these colours in turn (a slot's successive requests differ); phases differ by pattern
REQUEST_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94"]
# The same colours as a stepped colour scale: each bar's colour is its number, so plotly checks one numeric
# array instead of a colour string per bar (docs/host-path.md)
_REQUEST_SCALE = [[(i + edge) / len(REQUEST_COLORS), c] for i, c in enumerate(REQUEST_COLORS) for edge in (0, 1)]


def _strategies_with(run: RunData, frames: dict[str, pd.DataFrame]) -> list[str]:
    return [s for s, df in frames.items() if df is not None and not df.empty]


def slot_occupancy(run: RunData) -> go.Figure:
    """Slot × iteration, one bar per request's prefill and decode in its slot, coloured by request."""
    panels = []  # (title, tenures, iterations): one per strategy, one per engine of a fleet (disagg, replicas)
    for s in _strategies_with(run, run.slots):
        slots, its = run.slots[s], run.iterations.get(s, pd.DataFrame())
        workers = sorted(set(slots["worker"])) if "worker" in slots else [""]
        for w in workers:
            t = slots[slots["worker"] == w] if w else slots
            n = int((its["worker"] == w).sum()) if w and "worker" in its else len(its)
            a, b = middle_window(n, SLOT_ITERATIONS)
            name = f"{s} {w}" if w else s
            panels.append((name if (a, b) == (0, n) else f"{name}: iterations {a}–{b - 1} of {n} (a window from "
                           "the middle)", t, (a, b)))
    grid = Grid(max(len(panels), 1), titles=[p[0] for p in panels] or ["(no slot records)"],
                vertical_spacing=0.1 if len(panels) < 6 else 0.3 / len(panels))
    shown: set[str] = set()
    for row, (_, t, (a, b)) in enumerate(panels, start=1):
        t = t[(t["end_iteration"] >= a) & (t["start_iteration"] < b) & (t["end_iteration"] >= t["start_iteration"])]
        # [N] per tenure (in admission order) the middle of its colour's step of the scale: a slot's tenures
        # take the colours in turn from one that depends on the slot, so successive ones always differ
        color = (t["slot"].to_numpy() + t.groupby("slot").cumcount().to_numpy()) % len(REQUEST_COLORS) + 0.5
        decode_from = t["decode_iteration"].where(t["decode_iteration"] >= 0, t["end_iteration"] + 1)
        prefill_end = np.minimum(decode_from - 1, t["end_iteration"])
        beam = t["width"] > 1
        parts = [("prefill", t["start_iteration"], prefill_end, np.ones(len(t), bool), "/"),
                 ("decode", decode_from, t["end_iteration"], ~beam.to_numpy(), ""),
                 ("decode, beam search", decode_from, t["end_iteration"], beam.to_numpy(), "x")]
        for name, lo, hi, pick, pattern in parts:
            lo, hi = np.maximum(lo.to_numpy(), a), np.minimum(np.asarray(hi), b - 1)
            keep = pick & (hi >= lo)
            if not keep.any():
                continue
            d = t[keep]
            grid.add(go.Bar(y=d["slot"], x=(hi - lo + 1)[keep], base=lo[keep] - 0.5, orientation="h",
                            name=name, legendgroup=name, showlegend=name not in shown,
                            marker={"color": color[keep], "colorscale": _REQUEST_SCALE, "cmin": 0,
                                    "cmax": len(REQUEST_COLORS), "pattern": {"shape": pattern}, "line": {"width": 0}},
                            customdata=np.stack([d["request_id"].astype(str), d["width"], lo[keep], hi[keep]], axis=1),
                            hovertemplate=f"{name}: request %{{customdata[0]}} (beams %{{customdata[1]}})<br>"
                                          "slot %{y}, iterations %{customdata[2]}–%{customdata[3]}<extra></extra>"),
                     row)
            shown.add(name)
        pre = t[t["end"] == "preempted"]
        pre = pre[(pre["end_iteration"] >= a) & (pre["end_iteration"] < b)]
        if len(pre):
            grid.add(go.Scatter(x=pre["end_iteration"] + 0.5, y=pre["slot"], mode="markers", name="preempted",
                                legendgroup="preempted", showlegend="preempted" not in shown,
                                marker={"symbol": "x", "color": "#000", "size": 9},
                                customdata=pre["request_id"].astype(str),
                                hovertemplate="request %{customdata} preempted after iteration %{x:.0f}"
                                              "<extra></extra>"), row)
            shown.add("preempted")
        grid.yaxis(row).update(title={"text": "slot"}, autorange="reversed")
        grid.xaxis(row)["title"] = {"text": "iteration"}
    return grid.figure(f"Slot occupancy: which request holds each slot ({run.name}; colour: request, hatched: "
                       "prefill, crossed: beam search, ×: preempted)", max(320, 300 * len(panels)),
                       barmode="overlay", bargap=0.15)


def buffer_sets(run: RunData) -> go.Figure:
    """Each step's buffer set, held from the host's fill (prepare) until its outputs are read
    (postprocess), with the device's run of it inside; all strategies on one time scale. A fleet's engines
    (disagg's workers, replicas) each have buffer sets of their own: a lane group per worker."""
    strategies = _strategies_with(run, run.iterations)
    windows, span = {}, 0.0
    for s in strategies:
        it = run.iterations[s]
        a, b = middle_window(len(it), GANTT_ITERATIONS)  # the iteration timeline's steps
        w = it.iloc[a:b]
        t0 = float(w["prepare_start_s"].min())
        end = np.nanmax(w[["postprocess_end_s", "sample_end_s"]].to_numpy(float))
        windows[s], span = (w, t0), max(span, (end - t0) * 1e3)
    grid = Grid(max(len(strategies), 1), vertical_spacing=0.14,
                titles=[f"{s}: {len(windows[s][0])} steps from the middle of the run" for s in strategies]
                or ["(no iterations)"])
    for row, s in enumerate(strategies, start=1):
        w, t0 = windows[s]
        sets = w["buffer_set"] if "buffer_set" in w else w["micro_batch"]
        workers = w["worker"].fillna("").astype(str) if "worker" in w else [""] * len(w)  # a fleet's engines:
        lane = [f"{wk} set {int(k)}" if wk else f"set {int(k)}" for wk, k in zip(workers, sets, strict=True)]
        held_to = w["postprocess_end_s"].fillna(w["sample_end_s"])
        phases = (("held (filled → outputs read)", w["prepare_start_s"], held_to, "#c7dcef", 0.8, False),
                  ("device runs the step", w["forward_start_s"], w["sample_end_s"], "#1f77b4", 0.45, True))
        for name, start, end, color, width, labelled in phases:
            ok = (start.notna() & end.notna()).to_numpy()
            grid.add(go.Bar(y=np.array(lane)[ok], x=((end - start) * 1e3)[ok], base=((start - t0) * 1e3)[ok],
                            orientation="h", width=width, name=name, legendgroup=name, showlegend=row == 1,
                            marker_color=color, text=w["iteration"][ok] if labelled else None,
                            textposition="inside", customdata=w["iteration"][ok],
                            hovertemplate=f"{name}: iteration %{{customdata}}<br>%{{base:.3f}} ms +%{{x:.3f}} ms"
                                          "<extra></extra>"), row)
        grid.xaxis(row)["range"] = [0, span * 1.02]
        grid.yaxis(row)["categoryorder"] = "category ascending"
    grid.xaxis(max(len(strategies), 1))["title"] = {"text": "ms from the window's first fill"}
    return grid.figure(f"Buffer sets: which buffer set each step used, and when ({run.name}; one time scale for "
                       "every strategy)", max(300, 230 * len(strategies)), barmode="overlay")


def _binned_iterations(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(x, y, k): ``y`` as means of k consecutive iterations when there are more than FILL_POINTS."""
    k = max(1, -(-len(x) // FILL_POINTS))
    if k == 1:
        return x, y, 1
    n = len(x) // k * k
    return x[:n].reshape(-1, k).mean(axis=1), np.nanmean(y[:n].reshape(-1, k), axis=1), k


def _capacity(executor: dict, key: str) -> int | None:
    """A buffer's capacity from run.json's executor config (None: a run that did not record it)."""
    if key == "max_blocks_per_seq":  # a slot's block table: max_seq_len in blocks
        if "max_seq_len" not in executor or "tokens_per_block" not in executor:
            return None
        return -(-int(executor["max_seq_len"]) // int(executor["tokens_per_block"]))
    cap = executor.get(key)
    if key == "max_batch_size" and cap is not None:
        cap *= executor.get("max_beam_width", 1)  # a beam request's rows: one per beam
    return cap


def buffer_fill(runs: list[RunData], colors: dict[tuple[str, str], str]) -> go.Figure:
    """Per iteration: tokens packed into the runtime buffers, rows in the step I/O and KV blocks per
    running request, each beside its capacity (dashed)."""
    panels = [("Tokens in the runtime buffers", "max_num_tokens"), ("Rows in the step I/O (requests' rows)",
                                                                    "max_batch_size"),
              ("KV blocks per running request", "max_blocks_per_seq")]
    grid = Grid(3, titles=[p for p, _ in panels], shared_xaxes=True, vertical_spacing=0.07)
    multi, binned = len(runs) > 1, 1
    for run in runs:
        executor = run.meta.get("executor", {})
        for s, it in run.iterations.items():
            if it.empty:
                continue
            x = it["iteration"].to_numpy(float)
            rows = (it["num_context_requests"] + it["num_generation_requests"]).to_numpy(float)
            with np.errstate(invalid="ignore", divide="ignore"):
                per_slot = it["kv_blocks_used"].to_numpy(float) / it["active_slots"].to_numpy(float)
            label = f"{run.name} / {s}" if multi else s
            for i, y in enumerate((it["num_tokens"].to_numpy(float), rows, per_slot)):
                bx, by, k = _binned_iterations(x, y)
                binned = max(binned, k)
                grid.add(go.Scatter(x=bx, y=by, mode="lines", name=label, legendgroup=label, showlegend=i == 0,
                                    line={"color": colors.get((run.name, s), "#444"), "width": 1}), i + 1)
        for i, (_, key) in enumerate(panels):
            cap = _capacity(executor, key)
            if cap:
                grid.hline(cap, i + 1, {"dash": "dash", "color": "#888", "width": 1}, f"capacity {cap}")
    grid.xaxis(3)["title"] = {"text": "iteration"}
    note = f" — mean of each {binned} iterations" if binned > 1 else ""
    return grid.figure(f"Buffer fill per iteration, against capacity (dashed){note}", 720)
