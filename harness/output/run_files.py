"""The run directory's own files: ``run.json`` (what was run, on what, with which versions) and the
summary (``summary.csv``, ``summary.json``); each strategy's files are ``strategy_dir.py``'s."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
from pathlib import Path

import numpy as np
import pandas as pd

from harness.options import RunOptions
from harness.output.io import atomic_write_json, atomic_write_text
from harness.runner import StrategyRun
from harness.traces import Trace
from strategies.config import ExecutorConfig
from strategies.runtime.models.config import ModelConfig


def write_run_files(staging: Path, opts: RunOptions, executor: ExecutorConfig, sim_info: dict | None, trace: Trace,
                    model_cfg: ModelConfig, summary: pd.DataFrame, runs: list[StrategyRun]) -> None:
    """run.json (the options, executor, model, versions, trace and each strategy's wall time), summary.csv and
    summary.json, into the run's staging directory."""
    run_json = {
        "options": dataclasses.asdict(opts),
        "executor": executor.to_dict(),
        "model": model_cfg.to_dict(),
        "versions": versions(),
        "seed": opts.seed,
        "device": opts.device,
        "device_memory": executor.memory,
        # What the KV pools allocate: --kv-blocks x --tokens-per-block tokens (the simulated device: modelled).
        "kv_bytes": (sim_info["kv_bytes"] if sim_info else
                     executor.total_kv_blocks * executor.tokens_per_block * model_cfg.kv_bytes_per_token),
        # measured: real host code timed on the run clock; modelled: configured costs (simulated device)
        "host_time": executor.sim.host_time if executor.sim else "measured",
        "sim": sim_info,
        "trace": {"source": trace.source, "format": trace.format, "sha256": trace.sha256, "requests": len(trace),
                  "skipped_failed_rows": trace.skipped, "notes": list(trace.notes),
                  # a workload's load stages: requests.parquet's ``stage`` k was sent in stages[k]
                  "stages": [{"start_s": s, "end_s": e, "rate_rps": r} for s, e, r in trace.stages]},
        "strategies": [{"name": r.name, "wall_s": r.wall_s, "warmup_s": r.warmup_s, "error": r.error,
                        "interrupted": r.interrupted, "torch_threads": r.torch_threads,
                        "faults": r.extras.get("faults", []),
                        # when each load stage's clock started in this run (stages wait for a drain: source.py)
                        "stage_starts_s": r.extras.get("stage_starts_s", [])} for r in runs],
    }
    atomic_write_json(staging / "run.json", run_json)
    atomic_write_text(staging / "summary.csv", summary.to_csv(index=False))
    atomic_write_json(staging / "summary.json", json.loads(summary.to_json(orient="records")))


def versions() -> dict:
    """The versions a run's numbers depend on."""
    import nvtx
    import plotly

    # torch's version from its metadata: a simulated run never imports torch, and importing it takes ~1.3 s
    return {"python": platform.python_version(), "torch": importlib.metadata.version("torch"), "numpy": np.__version__,
            "pandas": pd.__version__, "plotly": plotly.__version__, "nvtx": getattr(nvtx, "__version__", "?"),
            "slotbench": _slotbench_version(), "platform": platform.platform()}


def _slotbench_version() -> str:
    try:
        return importlib.metadata.version("slotbench")
    except Exception:  # running from a source tree that was never installed
        return "source"
