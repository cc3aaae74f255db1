"""``slotbench suite FILE.toml``: several runs, one combined output; sequential or on Ray.

A suite file::

    name = "rate-sweep"          # output directory name under runs/ (default: the file's stem)
    baseline = "static"          # strategy the report's ratios are taken against
    repeats = 3                  # run each configuration 3 times, seeds seed, seed + 1, ... (default 1)
    [defaults]                   # any `slotbench run` option, with underscores
    model = "tiny"
    num_prompts = 100
    [sweep]                      # one run per value (the cartesian product if several keys)
    request_rate = [2.0, 4.0, 8.0]
    [[runs]]                     # and/or explicit runs, each with a name and overrides
    name = "chunked"
    chunked_prefill = true

Output: OUT/suite.json (every run, its parameters, seed and status: ok, stopped, failed, resumed or not
run), OUT/summary.csv (all runs, with ``run``, ``config``, ``repeat``, ``seed`` and the swept values),
OUT/summary_repeats.csv (with repeats: mean, 95% interval and CV per metric), OUT/report.html, and one
run directory per run (``NAME`` or, repeated, ``NAME@rI``). The same files whether the runs ran here
one after another or as Ray tasks.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from harness.app import prepare_out
from harness.errors import UserError
from harness.options import RunOptions

TOP_KEYS = {"name", "baseline", "repeats", "defaults", "sweep", "runs", "capacity"}


@dataclass(frozen=True)
class SuiteRun:
    name: str  # its directory: the configuration's name, with @rI when repeated
    config: str  # the configuration it repeats
    params: dict = field(hash=False)  # the suite's overrides for it (also summary columns)
    opts: RunOptions = field(hash=False)
    repeat: int = 0


@dataclass(frozen=True)
class RunResult:
    exit_code: int  # the run's own: 0, 1 (fault), 130 (interrupted), 2 (refused)
    error: str | None = None  # why it produced nothing, if it did not


def load_suite(path: Path) -> tuple[str, str | None, int, list[tuple[str, dict, RunOptions]], dict | None]:
    """(name, baseline, repeats, configurations, the [capacity] table if any) of a suite file."""
    if not path.is_file():
        raise UserError(f"{path}: no such suite file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML ({exc})") from None
    for key in data:
        if key not in TOP_KEYS:
            raise UserError(f"{path}: unknown key {key!r} (valid: {', '.join(sorted(TOP_KEYS))})")
    repeats = data.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise UserError(f"{path}: repeats must be a positive integer, got {repeats!r}")
    defaults = data.get("defaults", {})
    options_from_mapping(defaults, f"{path} [defaults]")  # validate once, up front
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
    configs = []
    seen = set()
    for name, params in entries:
        safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", name)
        if safe in seen:
            raise UserError(f"{path}: two runs are named {name!r}")
        seen.add(safe)
        configs.append((safe, params, options_from_mapping({**defaults, **params}, f"{path} run {name!r}")))
    capacity = data.get("capacity")
    if capacity is not None and not isinstance(capacity, dict):
        raise UserError(f"{path}: capacity must be a table ([capacity])")
    return str(data.get("name", path.stem)), data.get("baseline"), repeats, configs, capacity


def expand(configs: list[tuple[str, dict, RunOptions]], repeats: int) -> list[SuiteRun]:
    """One run per configuration, or ``repeats`` of each with consecutive seeds."""
    if repeats < 1:
        raise UserError(f"--repeats must be positive, got {repeats}")
    if repeats == 1:
        return [SuiteRun(name, name, params, opts) for name, params, opts in configs]
    return [SuiteRun(f"{name}@r{i}", name, params, replace(opts, seed=opts.seed + i), i)
            for name, params, opts in configs for i in range(repeats)]


def complete(run_dir: Path) -> bool:
    """A run directory is renamed into place whole, so its files mean it finished writing."""
    return (run_dir / "run.json").is_file() and (run_dir / "summary.csv").is_file()


def open_out(out: Path, force: bool, resume: bool) -> Path:
    """The suite directory: kept as it is to resume, else refused if it exists without ``force``."""
    if not resume:
        prepare_out(out, force)
    out.mkdir(parents=True, exist_ok=True)
    return out


def options_from_mapping(values: dict[str, Any], where: str) -> RunOptions:
    """From a suite table: unknown keys are named; lists and strings both work for strategies."""
    known = set(RunOptions.option_names())
    for key in values:
        if key not in known:
            raise UserError(f"{where}: unknown key {key!r}")
    values = dict(values)
    if isinstance(values.get("strategies"), str):
        values["strategies"] = tuple(s.strip() for s in values["strategies"].split(",") if s.strip())
    elif "strategies" in values:
        values["strategies"] = tuple(values["strategies"])
    if "request_rate" in values:
        values["request_rate"] = float(values["request_rate"])
    if isinstance(values.get("goodput"), str):
        values["goodput"] = tuple(values["goodput"].split())
    types = {f.name: f.type for f in fields(RunOptions)}
    for key, value in values.items():
        t = str(types[key])
        if t.startswith("int") and not (isinstance(value, int) and not isinstance(value, bool)):
            raise UserError(f"{where}: {key} must be an integer, got {value!r}")
        if t == "bool" and not isinstance(value, bool):
            raise UserError(f"{where}: {key} must be true or false, got {value!r}")
    try:
        return RunOptions(**values)
    except TypeError as exc:
        raise UserError(f"{where}: {exc}") from None
