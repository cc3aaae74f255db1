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
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from harness.app import EXIT_FAULT, EXIT_INTERRUPTED, execute, prepare_out
from harness.errors import UserError
from harness.io import atomic_write_json, atomic_write_text
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
    configs = []
    seen = set()
    for name, params in entries:
        safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", name)
        if safe in seen:
            raise UserError(f"{path}: two runs are named {name!r}")
        seen.add(safe)
        configs.append((safe, params, RunOptions.from_mapping({**defaults, **params}, f"{path} run {name!r}")))
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


def run_suite(path: Path, out: Path | None, *, force: bool = False, progress: bool = True,
              ray_address: str | None = None, resume: bool = False,
              repeats: int | None = None) -> tuple[int, Path, pd.DataFrame]:
    name, baseline, file_repeats, configs, capacity = load_suite(path)
    if capacity is not None:  # a search over request rate instead of the listed runs (harness/capacity.py)
        from harness.capacity import CapacitySpec, capacity_search

        if (repeats or file_repeats) > 1:  # each rate is evaluated once: repeats would be silently ignored
            raise UserError(f"{path}: a [capacity] search evaluates each rate once; repeats "
                            f"({repeats or file_repeats}) cannot be used with it")

        spec = CapacitySpec.from_mapping(capacity, str(path))
        out = open_out(out or Path("runs") / name, force, resume)
        return capacity_search(name, str(path), configs, spec, out, ray_address=ray_address, progress=progress,
                               resume=resume)
    runs = expand(configs, repeats or file_repeats)
    return execute_suite(name, str(path), baseline, runs, out or Path("runs") / name, force=force,
                         progress=progress, ray_address=ray_address, resume=resume)


def execute_suite(name: str, source: str, baseline: str | None, runs: list[SuiteRun], out: Path, *,
                  force: bool = False, progress: bool = True, ray_address: str | None = None,
                  resume: bool = False) -> tuple[int, Path, pd.DataFrame]:
    """Run what is not complete yet (everything, unless ``resume``), here or on Ray
    (``ray_address``: "" for a local Ray, else ``auto`` or ``ray://host:port``), and assemble OUT."""
    open_out(out, force, resume)
    todo = [r for r in runs if not (resume and complete(out / r.name))]
    results, interrupted = run_many(todo, out, ray_address, progress)
    return assemble(name, source, baseline, runs, results, out, interrupted)


def run_many(runs: list[SuiteRun], out: Path, ray_address: str | None,
             progress: bool) -> tuple[dict[str, RunResult], bool]:
    """Run each into OUT/<name>, here one after another or on Ray; results by name, and whether Ctrl-C
    stopped it."""
    if ray_address is not None:
        from harness.suite_ray import run_on_ray

        return run_on_ray(runs, out, ray_address, progress)
    results: dict[str, RunResult] = {}
    for run in runs:
        try:
            outcome = execute(run.opts, out / run.name, force=True, progress=progress, report=False)
            results[run.name] = RunResult(outcome.exit_code)
        except UserError as exc:
            results[run.name] = RunResult(2, str(exc))
        if results[run.name].exit_code == EXIT_INTERRUPTED:
            return results, True
    return results, False


def assemble(name: str, source: str, baseline: str | None, runs: list[SuiteRun], results: dict[str, RunResult],
             out: Path, interrupted: bool) -> tuple[int, Path, pd.DataFrame]:
    """suite.json, summary.csv, summary_repeats.csv and the report, from the run directories in OUT."""
    entries, frames, code = [], [], EXIT_INTERRUPTED if interrupted else 0
    for run in runs:
        result, done = results.get(run.name), complete(out / run.name)
        # resumed: complete from before; failed: produced no run directory; stopped: wrote one, but a
        # strategy stopped early (engine fault, Ctrl-C) — its own run.json says which
        status = ("resumed" if result is None and done else "not run" if result is None
                  else "failed" if result.error or not done else "stopped" if result.exit_code else "ok")
        entry = {"name": run.name, "dir": run.name, "config": run.config, "repeat": run.repeat,
                 "seed": run.opts.seed, "params": run.params, "status": status}
        if result is not None and result.error:
            entry["error"] = result.error
        if status == "failed" or (status == "not run" and not interrupted):  # a refused run (2) fails too
            code = max(code, EXIT_FAULT)
        elif result is not None:
            code = max(code, result.exit_code)
        if done:
            summary = pd.read_csv(out / run.name / "summary.csv")
            frames.append(summary.assign(run=run.name, config=run.config, repeat=run.repeat, seed=run.opts.seed,
                                         **{k: str(v) for k, v in run.params.items()}))
            entries.append(entry)
        else:
            entries.append({**entry, "dir": None})
    summary = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    atomic_write_json(out / "suite.json", {"name": name, "file": source, "baseline": baseline, "runs": entries})
    atomic_write_text(out / "summary.csv", summary.to_csv(index=False))
    if any(r.repeat for r in runs) and not summary.empty:
        from reports.repeats import repeat_table

        atomic_write_text(out / "summary_repeats.csv", repeat_table(summary).to_csv(index=False))
    if frames:
        from reports.html import write_report

        write_report([out], out / "report.html", baseline=baseline, title=f"slotbench suite: {name}")
    return code, out, summary
