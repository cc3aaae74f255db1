"""``slotbench compare RUN MEASURED…``: a run's predictions against measured serving runs, stage by stage.

Writes the table (``harness/compare/table.py``'s columns, with ``strategy`` first) to RUN/compare.csv (or
``out``) and renders RUN/report.html again, now with its "Predicted against measured" section; returns
the table and a short text of its headline figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from harness.compare.measured import FIGURE_COLUMNS, read_measured
from harness.compare.table import compare, predicted_figures
from harness.errors import UserError
from harness.output.io import atomic_write_text


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="a run's figures per load stage against measured runs, with relative errors: "
                                       "RUN/compare.csv and a section in its report")
    p.add_argument("run_dir", help="a run directory (e.g. of --workload-config)")
    p.add_argument("measured", nargs="+", help="a ../shared/validation JSON, inference-perf lifecycle reports (or "
                                               "their directory), or `vllm bench serve --save-result` files")
    p.add_argument("--strategy", default=None, help="the run's strategy to compare (default: each of them)")
    p.add_argument("--out", default=None, help="the table (default: RUN_DIR/compare.csv)")


def cmd_compare(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    print(compare_run(Path(args.run_dir), [Path(m) for m in args.measured], args.strategy, out)[1])
    return 0


HEADLINE = [("ttft_ms", "mean"), ("ttft_ms", "median"), ("ttft_ms", "p90"), ("ttft_ms", "p99"), ("e2el_ms", "mean"),
            ("e2el_ms", "median"), ("e2el_ms", "p90"), ("e2el_ms", "p99"), ("tpot_ms", "mean")]


def compare_run(run: Path, measured: list[Path], strategy: str | None = None,
                out: Path | None = None) -> tuple[pd.DataFrame, str]:
    if not (run / "summary.csv").is_file() or not (run / "run.json").is_file():
        raise UserError(f"{run}: not a run directory (no summary.csv or run.json)")
    meta = json.loads((run / "run.json").read_text())
    stages = (meta.get("trace") or {}).get("stages") or []
    strategies = [str(s) for s in pd.read_csv(run / "summary.csv")["strategy"]]
    if strategy is not None and strategy not in strategies:
        raise UserError(f"--strategy {strategy!r}: the run has {', '.join(strategies)}")
    meas = pd.DataFrame([row for path in measured for row in read_measured(path)], columns=FIGURE_COLUMNS)
    n_stages = int(meas.loc[meas["stage"] >= 0, "stage"].max()) + 1 if (meas["stage"] >= 0).any() else 0
    if n_stages and n_stages != len(stages):
        raise UserError(f"{run}: {len(stages)} load stages, the measured run {n_stages}: replay its workload "
                        "(--workload-config) to compare stage by stage")
    tables = []
    for name in [strategy] if strategy else strategies:
        path = run / name / "requests.parquet"
        if not path.is_file():
            continue
        predicted = predicted_figures(pd.read_parquet(path), stages)
        tables.append(compare(predicted, meas).assign(strategy=name))
    if not tables:
        raise UserError(f"{run}: no strategy's requests.parquet to compare")
    table = pd.concat(tables, ignore_index=True)
    table = table[["strategy", *[c for c in table.columns if c != "strategy"]]]
    dest = out or run / "compare.csv"
    atomic_write_text(dest, table.to_csv(index=False))
    if dest.parent == run and (run / "report.html").is_file():
        from reports.html import write_report

        write_report([run], run / "report.html", names=[run.name])
    return table, headline(table) + f"\nwrote {dest}"


def headline(table: pd.DataFrame) -> str:
    """One line per strategy and stage: TTFT and E2E mean, median, p90 and p99, TPOT, and the failed requests where the
    measured run had some, predicted vs measured."""
    lines = []
    for (strategy, source, stage), g in table.groupby(["strategy", "source", "stage"], sort=False):
        parts = []
        for metric, stat in HEADLINE:
            row = g[(g["metric"] == metric) & (g["stat"] == stat)]
            if len(row):
                r = row.iloc[0]
                parts.append(f"{metric[:-3]} {stat} {r.predicted:,.1f} vs {r.measured:,.1f} ms ({r.rel_error:+.1%})")
        failed = g[(g["metric"] == "failed_pct") & (g["measured"] > 0)]
        if len(failed):  # where the measured client gave up on requests: how many the replay's did
            parts.append(f"failed {failed.iloc[0].predicted:.1f}% vs {failed.iloc[0].measured:.1f}%")
        sat = g[g["metric"] == "saturated_pct"]
        if len(sat):
            parts.append(f"saturated {sat.iloc[0].predicted:.0f}%")
        label = "all" if stage < 0 else str(stage)
        lines.append(f"{strategy} / {source} / stage {label}: " + "; ".join(parts))
    return "\n".join(lines)
