"""Read run directories into the DataFrames the report is built from (documented columns only).

A run directory holds ``summary.csv``, ``run.json`` and, per strategy, ``requests.parquet``,
``iterations.parquet``, ``slots.parquet`` and ``tokens.jsonl`` (docs/outputs.md: the output contract). A
suite directory holds several run directories and a ``suite.json`` naming them with their swept
parameters. A ``.json`` file is a ``vllm bench serve --save-result`` file (``reports/vllm_result.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pandas as pd

from reports.run_data import RunData, StrategyFrames
from reports.token_times import TokenTimes
from reports.vllm_result import is_vllm_result, load_vllm_result


def load_run(path: Path, name: str | None = None, frames: dict[str, StrategyFrames] | None = None) -> RunData:
    """A run directory; a strategy in ``frames`` is taken from them instead of its files (the run that
    wrote them renders its report from what it holds)."""
    if not (path / "summary.csv").is_file():
        raise ValueError(f"{path}: not a run directory (no summary.csv)")
    meta = json.loads((path / "run.json").read_text()) if (path / "run.json").is_file() else {}
    summary = pd.read_csv(path / "summary.csv")
    data = RunData(name or path.name, path, meta, summary)
    if (path / "compare.csv").is_file():  # written by `slotbench compare`
        data.compare = pd.read_csv(path / "compare.csv")
    for strategy in summary["strategy"]:
        d = path / str(strategy)
        if not d.is_dir():
            continue
        if (d / "slices.csv").is_file():  # written with --slice-duration
            data.slices[strategy] = pd.read_csv(d / "slices.csv")
        if (d / "server_metrics.parquet").is_file():  # written by run --endpoint --scrape-interval
            data.server[strategy] = pd.read_parquet(d / "server_metrics.parquet")
        held = (frames or {}).get(strategy)
        if held is not None:
            data.requests[strategy], data.iterations[strategy] = held.requests, held.iterations
            data.slots[strategy] = held.slots
            times = held.token_times
        else:
            data.requests[strategy] = pd.read_parquet(d / "requests.parquet")
            data.iterations[strategy] = pd.read_parquet(d / "iterations.parquet")
            if (d / "slots.parquet").is_file():  # runs written before slot tenures were recorded have none
                data.slots[strategy] = pd.read_parquet(d / "slots.parquet")
            with open(d / "tokens.jsonl", "rb") as f:
                lines = [orjson.loads(line) for line in f]
            times = TokenTimes.of({obj["request_id"]: obj["times_s"] for obj in lines},
                                  data.requests[strategy]["request_id"])
        finished = (data.requests[strategy]["status"] == "finished").to_numpy()  # [R], the token times' rows
        data.token_times[strategy] = times.flat  # every token's time, requests in row order
        data.itl_ms[strategy] = times.chunk_gaps(finished) * 1e3  # the finished requests' ITL, one per chunk
    return data


def load_runs(paths: list[Path], names: list[str] | None = None,
              frames: dict[str, StrategyFrames] | None = None) -> list[RunData]:
    """Run directories, suite directories (expanded into their runs), or vLLM result files; ``frames``: a
    single run's strategies as its run holds them (``load_run``)."""
    if frames is not None and len(paths) != 1:
        raise ValueError("frames are one run's: give them with that run's directory alone")
    runs: list[RunData] = []
    for i, p in enumerate(paths):
        suite = p / "suite.json"
        if is_vllm_result(p):  # a `vllm bench serve --save-result` file: a real server's run
            runs.append(load_vllm_result(p, names[i] if names and i < len(names) else None))
        elif suite.is_file():
            for entry in json.loads(suite.read_text())["runs"]:
                if entry.get("dir") is None:  # failed or not run: listed in suite.json, nothing to show
                    continue
                run = load_run(p / entry["dir"], entry["name"])
                run.meta["suite_params"] = entry.get("params", {})
                run.meta["suite_config"], run.meta["suite_repeat"] = entry.get("config", entry["name"]), entry.get(
                    "repeat", 0)
                runs.append(run)
        else:
            runs.append(load_run(p, names[i] if names and i < len(names) else None, frames))
    seen: dict[str, int] = {}
    for run in runs:  # the same directory twice, or two runs named alike: keep labels distinct
        seen[run.name] = seen.get(run.name, 0) + 1
        if seen[run.name] > 1:
            run.name = f"{run.name} #{seen[run.name]}"
    return runs


def load_capacity(paths: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """A capacity search's ``capacity.csv`` and ``capacity_points.csv`` (the first suite that has them)."""
    for p in paths:
        if (p / "capacity.csv").is_file() and (p / "capacity_points.csv").is_file():
            points = (pd.read_csv(p / "capacity_points.csv") if (p / "capacity_points.csv").stat().st_size > 1
                      else pd.DataFrame())
            return pd.read_csv(p / "capacity.csv"), points
    return None
