"""Capacity search: the highest request rate at which a configuration meets its SLOs.

A suite with a ``[capacity]`` table::

    [capacity]
    goodput = ["ttft:2000", "tpot:100"]   # SLOs, as --goodput
    min_fraction = 0.9                    # of the requests sent that must meet every SLO
    rate_lo = 0.5                         # the bracket searched, req/s
    rate_hi = 64.0
    tolerance = 0.05                      # stop when hi / lo <= 1 + tolerance (>= 0.001)

searches every (configuration, strategy) of the suite. Bracketing bisection in log rate: the first round
runs every configuration at ``rate_lo`` and ``rate_hi`` (below range if ``rate_lo`` already fails, at
least ``rate_hi`` if that passes); each later round runs every open bracket's geometric midpoint, all
configurations of a round together (as Ray tasks with ``--ray``), until each bracket is within the
tolerance: ceil(log2(log(hi / lo) / log(1 + tolerance))) rounds after the first (7 for 0.5-64 at 5%).
The passing end of the bracket is the capacity. Assumes attainment falls as the rate rises; every run
is kept, so a violation shows in ``capacity_points.csv``. A replayed trace keeps its own arrival pattern
(bursts, sessions) and reaches a rate by ``--time-scale``: its mean rate after fitting at scale 1 (requests
− 1 over the span of their arrivals) divided by the rate searched.

Output, besides a suite's usual files (every evaluated run is a run directory): ``capacity.csv`` (one
row per configuration: max_rate, its attainment, goodput, throughput, per-GPU and per-user tokens/s,
status, runs) and ``capacity_points.csv`` (every evaluation); the report draws the Pareto figure.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from harness.errors import UserError
from harness.metrics import parse_goodput
from harness.options import RunOptions
from harness.output.io import atomic_write_text
from harness.suite.execute import assemble, run_many
from harness.suite.on_ray import ray_session
from harness.suite.spec import SuiteRun, complete


@dataclass(frozen=True)
class CapacitySpec:
    goodput: tuple[str, ...]  # SLOs as METRIC:MS
    min_fraction: float = 0.9  # of the requests sent, meeting every SLO
    rate_lo: float = 0.5  # req/s
    rate_hi: float = 64.0
    tolerance: float = 0.05  # final hi / lo - 1

    def __post_init__(self) -> None:
        if not self.goodput:
            raise UserError("[capacity] needs goodput SLOs, e.g. goodput = [\"ttft:2000\", \"tpot:100\"]")
        parse_goodput(list(self.goodput))
        if not 0 < self.min_fraction <= 1:
            raise UserError(f"[capacity] min_fraction must be in (0, 1], got {self.min_fraction}")
        if not 0 < self.rate_lo < self.rate_hi < math.inf:
            raise UserError(f"[capacity] need 0 < rate_lo < rate_hi, got {self.rate_lo}, {self.rate_hi}")
        if not self.tolerance >= 1e-3:  # finer than the rates' 8 significant digits in run names can hold
            raise UserError(f"[capacity] tolerance must be >= 0.001, got {self.tolerance}")

    @classmethod
    def from_mapping(cls, values: dict, where: str) -> CapacitySpec:
        known = {"goodput", "min_fraction", "rate_lo", "rate_hi", "tolerance"}
        if unknown := set(values) - known:
            raise UserError(f"{where} [capacity]: unknown key {sorted(unknown)[0]!r}")
        goodput = values.get("goodput", ())
        goodput = tuple(goodput.split()) if isinstance(goodput, str) else tuple(goodput)
        try:
            return cls(goodput, **{k: float(v) for k, v in values.items() if k != "goodput"})
        except (TypeError, ValueError) as exc:
            raise UserError(f"{where} [capacity]: {exc}") from None


def _attainment(run_dir: Path) -> tuple[float, dict] | None:
    if not complete(run_dir):
        return None
    row = pd.read_csv(run_dir / "summary.csv").iloc[0].to_dict()
    value = row.get("slo_attainment", math.nan)
    return (0.0 if pd.isna(value) else float(value)), row


def capacity_search(name: str, source: str, configs: list[tuple[str, dict, RunOptions]], spec: CapacitySpec,
                    out: Path, *, ray_address: str | None = None, progress: bool = True,
                    resume: bool = False) -> tuple[int, Path, pd.DataFrame]:
    """Search every (configuration, strategy); writes capacity.csv, capacity_points.csv and the suite's
    files; returns the suite's (exit code, OUT, summary of every evaluated run). ``resume`` reuses the
    evaluations already complete in OUT (the search is deterministic, so it asks for the same rates)."""
    targets = {f"{cfg}.{s}": (params, replace(opts, strategies=(s,), goodput=spec.goodput))
               for cfg, params, opts in configs for s in opts.strategies}
    natural = {t: _natural_rate(opts) for t, (_, opts) in targets.items()}  # replays: their own mean rate
    brackets = {t: [spec.rate_lo, spec.rate_hi] for t in targets}
    status: dict[str, str] = {}
    evaluated: list[SuiteRun] = []
    points: list[dict] = []
    pending = {t: [spec.rate_lo, spec.rate_hi] for t in targets}
    interrupted, results = False, {}
    with ray_session(ray_address) if ray_address is not None else nullcontext():  # one Ray for every round
        while pending and not interrupted:
            batch = [SuiteRun(f"{t}@rate={r:.8g}", t, {**targets[t][0], **_at_rate(r, natural[t])},
                              replace(targets[t][1], **_at_rate(r, natural[t])))
                     for t, rates in pending.items() for r in rates]
            todo = [r for r in batch if not (resume and complete(out / r.name))]  # names are the rates: reusable
            got_round, interrupted = run_many(todo, out, ray_address, progress)
            results.update(got_round)
            evaluated += batch
            passed: dict[tuple[str, float], bool] = {}
            for run in batch:
                got = _attainment(out / run.name)
                if got is None:
                    if not interrupted:  # an interrupted round's missing runs are not failures
                        status[run.config] = f"failed at {run.opts.request_rate:g} req/s"
                    continue
                attain, row = got
                passed[run.config, run.opts.request_rate] = attain >= spec.min_fraction
                points.append({"config": run.config, "request_rate": run.opts.request_rate, "slo_attainment": attain,
                               "meets": attain >= spec.min_fraction, **_per_gpu_and_user(row, run.opts)})
            pending = {}
            for t, (lo, hi) in brackets.items():
                if t in status:
                    continue
                if (t, spec.rate_lo) in passed and (t, spec.rate_hi) in passed:  # the first round
                    if not passed[t, spec.rate_lo]:
                        status[t] = "below range"
                        continue
                    if passed[t, spec.rate_hi]:
                        status[t] = "at least rate_hi"
                        continue
                mid = math.sqrt(lo * hi)
                if (t, mid) in passed:
                    brackets[t] = [mid, hi] if passed[t, mid] else [lo, mid]
                    lo, hi = brackets[t]
                if hi / lo <= 1 + spec.tolerance:
                    status[t] = "bracketed"
                else:
                    pending[t] = [math.sqrt(lo * hi)]
    table = _capacity_table(targets, brackets, status, pd.DataFrame(points), spec)
    atomic_write_text(out / "capacity.csv", table.to_csv(index=False))
    atomic_write_text(out / "capacity_points.csv", pd.DataFrame(points).to_csv(index=False))
    return assemble(name, source, None, evaluated, results, out, interrupted)


def _natural_rate(opts: RunOptions) -> float | None:
    """A replayed trace's mean request rate once fitted at time scale 1; None for a synthetic trace."""
    if opts.trace == "synthetic":
        return None
    from harness.plan import make_trace

    arrivals = [r.arrival_s for r in make_trace(replace(opts, time_scale=1.0)).requests]
    span = max(arrivals) - min(arrivals)
    if len(arrivals) < 2 or span <= 0:
        raise UserError(f"{opts.trace}: a capacity search needs a replay whose arrivals span some time")
    return (len(arrivals) - 1) / span


def _at_rate(rate: float, natural: float | None) -> dict:
    """The options that make a run arrive at ``rate`` req/s on average."""
    return {"request_rate": rate} if natural is None else {"request_rate": rate, "time_scale": natural / rate}


def _per_gpu_and_user(row: dict, opts: RunOptions) -> dict:
    # a worker is --tp GPUs on sim (one device otherwise); disagg has P + D of them, --num-replicas N
    engines = (opts.num_prefill_workers + opts.num_decode_workers if opts.strategies == ("disagg",)
               else opts.num_replicas)
    gpus = (opts.tp if opts.device == "sim" else 1) * engines
    tpot = row.get("median_tpot_ms", math.nan)
    return {"gpus": gpus, "output_throughput": row.get("output_throughput", math.nan),
            "request_goodput": row.get("request_goodput", math.nan),
            "output_tok_s_per_gpu": row.get("output_throughput", math.nan) / gpus,
            "tok_s_per_user": 1e3 / tpot if tpot and not pd.isna(tpot) else math.nan}


def _capacity_table(targets: dict, brackets: dict, status: dict, points: pd.DataFrame,
                    spec: CapacitySpec) -> pd.DataFrame:
    rows = []
    for t in targets:
        config, _, strategy = t.rpartition(".")
        st = status.get(t, "interrupted")
        rate = {"below range": math.nan, "at least rate_hi": spec.rate_hi}.get(st, brackets[t][0])
        mine = points[points["config"] == t] if len(points) else points
        at = mine[mine["request_rate"] == rate] if len(mine) and not math.isnan(rate) else mine.iloc[0:0]
        best = at.iloc[0].to_dict() if len(at) else {}
        rows.append({"config": config, "strategy": strategy, "max_rate": rate, "status": st, "runs": len(mine),
                     **{k: best.get(k, math.nan) for k in ("gpus", "slo_attainment", "request_goodput",
                                                           "output_throughput", "output_tok_s_per_gpu",
                                                           "tok_s_per_user")}})
    return pd.DataFrame(rows)
