"""``slotbench suite FILE.toml``: several runs, one combined output.

A suite file::

    name = "rate-sweep"          # output directory name under runs/ (default: the file's stem)
    baseline = "static"          # strategy the report's ratios are taken against
    [defaults]                   # any `slotbench run` option, with underscores
    model = "tiny"
    num_prompts = 100
    [sweep]                      # one run per value (the cartesian product if several keys)
    request_rate = [2.0, 4.0, 8.0]
    [[runs]]                     # and/or explicit runs, each with a name and overrides
    name = "chunked"
    chunked_prefill = true

Output: OUT/suite.json, OUT/summary.csv (all runs, with a ``run`` column and the swept values),
OUT/report.html, and one run directory per run.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

import pandas as pd

from harness.app import EXIT_INTERRUPTED, execute, prepare_out
from harness.errors import UserError
from harness.io import atomic_write_json, atomic_write_text
from harness.options import RunOptions

TOP_KEYS = {"name", "baseline", "defaults", "sweep", "runs"}


def load_suite(path: Path) -> tuple[str, str | None, list[tuple[str, dict, RunOptions]]]:
    if not path.is_file():
        raise UserError(f"{path}: no such suite file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML ({exc})") from None
    for key in data:
        if key not in TOP_KEYS:
            raise UserError(f"{path}: unknown key {key!r} (valid: {', '.join(sorted(TOP_KEYS))})")
    defaults = data.get("defaults", {})
    RunOptions.from_mapping(defaults, f"{path} [defaults]")  # validate once, up front
    entries: list[tuple[str, dict]] = []
    sweep = data.get("sweep", {})
    if sweep:
        for key, values in sweep.items():
            if key not in RunOptions.option_names():
                raise UserError(f"{path} [sweep]: unknown key {key!r}")
            if not isinstance(values, list) or not values:
                raise UserError(f"{path} [sweep]: {key} must be a non-empty list")
        keys = list(sweep)
        for combo in itertools.product(*(sweep[k] for k in keys)):
            params = dict(zip(keys, combo, strict=True))
            entries.append(("-".join(f"{k}={v}" for k, v in params.items()), params))
    for i, run in enumerate(data.get("runs", [])):
        run = dict(run)
        name = str(run.pop("name", f"run{i}"))
        entries.append((name, run))
    if not entries:
        entries.append(("default", {}))
    runs = []
    seen = set()
    for name, params in entries:
        safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", name)
        if safe in seen:
            raise UserError(f"{path}: two runs are named {name!r}")
        seen.add(safe)
        runs.append((safe, params, RunOptions.from_mapping({**defaults, **params}, f"{path} run {name!r}")))
    return str(data.get("name", path.stem)), data.get("baseline"), runs


def run_suite(path: Path, out: Path | None, *, force: bool = False,
              progress: bool = True) -> tuple[int, Path, pd.DataFrame]:
    name, baseline, runs = load_suite(path)
    out = out or Path("runs") / name
    prepare_out(out, force)
    out.mkdir(parents=True, exist_ok=True)
    entries, frames, code = [], [], 0
    for run_name, params, opts in runs:
        outcome = execute(opts, out / run_name, force=True, progress=progress, report=False)
        entries.append({"name": run_name, "dir": run_name, "params": params})
        frames.append(outcome.summary.assign(run=run_name, **{k: str(v) for k, v in params.items()}))
        code = max(code, outcome.exit_code)
        if outcome.exit_code == EXIT_INTERRUPTED:
            break
    summary = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    atomic_write_json(out / "suite.json", {"name": name, "file": str(path), "baseline": baseline, "runs": entries})
    atomic_write_text(out / "summary.csv", summary.to_csv(index=False))
    from reports.html import write_report

    write_report([out], out / "report.html", baseline=baseline, title=f"slotbench suite: {name}")
    return code, out, summary
