"""What the report knows of one run: its summary and, per strategy, the documented DataFrames."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from reports.token_times import TokenTimes


@dataclass
class StrategyFrames:
    """One strategy's records as a run that just measured them holds them: what the report would otherwise
    read back from the files written from them (``requests.parquet``, ``iterations.parquet``,
    ``slots.parquet``, ``tokens.jsonl``), to render a run's own report without reading them again."""

    requests: pd.DataFrame  # requests.parquet's columns
    iterations: pd.DataFrame  # iterations.parquet's columns
    slots: pd.DataFrame  # slots.parquet's columns
    token_times: TokenTimes  # the token times of ``requests``' rows, in row order (tokens.jsonl's times_s)


@dataclass
class RunData:
    name: str  # label shown in the report
    path: Path
    meta: dict
    summary: pd.DataFrame
    requests: dict[str, pd.DataFrame] = field(default_factory=dict)  # strategy → requests.parquet
    iterations: dict[str, pd.DataFrame] = field(default_factory=dict)  # strategy → iterations.parquet
    slots: dict[str, pd.DataFrame] = field(default_factory=dict)  # strategy → slots.parquet (when recorded)
    itl_ms: dict[str, np.ndarray] = field(default_factory=dict)  # strategy → pooled inter-token gaps
    token_times: dict[str, np.ndarray] = field(default_factory=dict)  # strategy → every token's time
    slices: dict[str, pd.DataFrame] = field(default_factory=dict)  # strategy → slices.csv (--slice-duration)
    # strategy → server_metrics.parquet (run --endpoint --scrape-interval): time_s and the server's running,
    # waiting, kv_cache_usage, preemptions, prompt_tokens, generation_tokens as its /metrics said then
    server: dict[str, pd.DataFrame] = field(default_factory=dict)
    compare: pd.DataFrame | None = None  # compare.csv (`slotbench compare`: predicted against measured)
