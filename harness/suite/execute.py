"""Running a suite's runs (here one after another, or on Ray) and assembling OUT from their directories."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.app import EXIT_FAULT, EXIT_INTERRUPTED, execute
from harness.errors import UserError
from harness.output.io import atomic_write_json, atomic_write_text
from harness.suite.spec import RunResult, SuiteRun, complete, open_out


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
        from harness.suite.on_ray import run_on_ray

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
