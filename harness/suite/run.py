"""``slotbench suite FILE.toml``: the listed runs, or a capacity search when the file has ``[capacity]``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.errors import UserError
from harness.suite.capacity import CapacitySpec, capacity_search
from harness.suite.execute import execute_suite
from harness.suite.spec import expand, load_suite, open_out


def run_suite(path: Path, out: Path | None, *, force: bool = False, progress: bool = True,
              ray_address: str | None = None, resume: bool = False,
              repeats: int | None = None) -> tuple[int, Path, pd.DataFrame]:
    name, baseline, file_repeats, configs, capacity = load_suite(path)
    if capacity is not None:  # a search over request rate instead of the listed runs (harness/suite/capacity.py)
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
