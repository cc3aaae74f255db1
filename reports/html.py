"""One self-contained HTML report: plotly.js embedded once, every string escaped, no network."""

from __future__ import annotations

import html
import json
import os
import tempfile
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from reports import buffers, figures
from reports.capacity import capacity_pareto
from reports.load import load_capacity, load_runs
from reports.repeats import repeat_table
from reports.run_data import RunData, StrategyFrames
from reports.speculation import speculation
from reports.tables import overlap_table, ratio_table, summary_table, to_html_table

REPEAT_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px} h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table.data{border-collapse:collapse;font-size:12px;display:block;overflow-x:auto}
table.data td,table.data th{border:1px solid #ddd;padding:3px 6px;text-align:right;white-space:nowrap}
table.data th{background:#f4f4f4} pre{background:#f7f7f7;padding:8px;font-size:11px;overflow:auto;max-height:300px}
.note{color:#666;font-size:13px}
"""


def _figure_div(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def render(runs: list[RunData], baseline: str | None = None, title: str = "slotbench report",
           capacity: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> str:
    summary = summary_table([(r.name, r.summary) for r in runs])
    strategies = list(dict.fromkeys(summary["strategy"]))
    baseline = baseline if baseline in strategies else ("static" if "static" in strategies else strategies[0])
    parts = [f"<h1>{html.escape(title)}</h1>",
             '<p class="note">Runs: ' + ", ".join(html.escape(r.name) for r in runs) + "</p>",
             "<h2>Summary</h2>", to_html_table(summary)]
    overlap = overlap_table(summary)
    if not overlap.empty:
        parts += ["<h2>Host and device</h2>",
                  '<p class="note">overlap_headroom: host time over host + device time per iteration — what a '
                  "strategy that prepares step n+1 while step n runs could hide; host_hidden_fraction: the share "
                  "of host time that did run while the device was busy. Where the headroom is small, overlap has "
                  "little to gain; where the hidden share is high, it took what there was.</p>",
                  to_html_table(overlap)]
    compared = [r.compare.assign(run=r.name) for r in runs if r.compare is not None]
    if compared:
        parts += ["<h2>Predicted against measured</h2>",
                  '<p class="note">From `slotbench compare`: each measured figure of each load stage (stage -1: the '
                  "whole run) beside this run's, rel_error = predicted / measured − 1. TPOT is (mean E2E − mean "
                  "TTFT) / (output tokens − 1) on both sides; saturated_pct: requests unfinished or with TTFT over "
                  "10 s (predicted only).</p>", to_html_table(pd.concat(compared, ignore_index=True))]
    parts += [f"<h2>Ratios against {html.escape(baseline)}</h2>",
              '<p class="note">Each metric divided by the baseline strategy\'s in the same run: throughputs '
              "above 1 and latencies below 1 are better.</p>",
              to_html_table(ratio_table(summary, baseline))]
    repeated = summary.assign(config=[r.meta.get("suite_config", r.name) for r in runs for _ in r.summary.index],
                              repeat=[r.meta.get("suite_repeat", 0) for r in runs for _ in r.summary.index])
    stats = repeat_table(repeated) if repeated["repeat"].max() > 0 else pd.DataFrame()
    if not stats.empty:
        parts += ["<h2>Repeats</h2>",
                  '<p class="note">Mean, half-width of the 95% confidence interval (Student t) and coefficient '
                  "of variation across repeats with consecutive seeds.</p>",
                  to_html_table(stats[["config", "strategy", "repeats"]
                                      + [c for c in stats.columns if c.startswith(REPEAT_METRICS)]])]
    if capacity is not None:
        parts += ["<h2>Capacity</h2>",
                  '<p class="note">The highest request rate at which each configuration met its SLOs '
                  "(harness/suite/capacity.py says how it was searched).</p>", to_html_table(capacity[0])]
    figs: list[tuple[str, go.Figure]] = []
    if capacity is not None and len(capacity[1]):
        figs.append(("Capacity: Pareto", capacity_pareto(capacity[1])))
    if not stats.empty:
        figs.append(("Repeats", figures.repeats(stats, REPEAT_METRICS)))
    sweep = figures.sweep(runs)
    if sweep is not None:
        figs.append(("Sweep", sweep))
    figs += [("Latency", figures.latency_cdfs(runs)), ("Over time", figures.over_time(runs)),
             ("KV cache", figures.kv_cache(runs)), ("Padding", figures.padding(runs))]
    spec = speculation(runs)
    if spec is not None:
        figs.append(("Speculative decoding", spec))
    engines = [r for r in runs if any(not it.empty for it in r.iterations.values())][:4]  # a vLLM file has none
    figs += [(f"Iteration timeline: {r.name}", figures.iteration_gantt(r)) for r in engines]
    figs += [(f"Slot occupancy: {r.name}", buffers.slot_occupancy(r)) for r in engines if r.slots]
    figs += [(f"Buffer sets: {r.name}", buffers.buffer_sets(r)) for r in engines]
    figs.append(("Buffer fill", buffers.buffer_fill(runs, figures.strategy_colors(runs))))
    for i, (heading, fig) in enumerate(figs):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        parts.append(_figure_div(fig, f"fig{i}"))
    parts.append("<h2>Run metadata</h2>")
    for r in runs:
        meta = json.dumps(r.meta, indent=2, default=str)
        parts.append(f"<h3>{html.escape(r.name)}</h3><pre>{html.escape(meta)}</pre>")
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>{''.join(parts)}</body></html>")


def write_report(paths: list[Path], out: Path, names: list[str] | None = None, baseline: str | None = None,
                 title: str = "slotbench report", frames: dict[str, StrategyFrames] | None = None) -> Path:
    """Render the run (or suite) directories in ``paths`` into ``out``, written atomically; ``frames``: a
    single run's strategies as the run that wrote them holds them (not read back from their files)."""
    text = render(load_runs(paths, names, frames), baseline, title, load_capacity(paths))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    return out
