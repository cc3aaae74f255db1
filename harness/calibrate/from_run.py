"""``slotbench calibrate RUN_DIR``: fit a device profile to a real run's iterations.

Each iteration's device time (forward start → sample end) is modelled from the cost model's per-kernel
FLOPs and bytes for the batch it computed, with one compute and one memory efficiency for every kernel
(a real run times whole steps, not kernels), two ways: the sum over kernels of each one's roofline
max(FLOPs / (peak × eff_flops), bytes / (bandwidth × eff_bw)) + overhead + per-row cost — the
efficiencies by least squares over a log grid refined once, the rest linear — and the additive
FLOPs × a + bytes × b + overhead + per-row cost by linear least squares. The better fit wins. Launch and
sync latencies are the medians the records show.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from harness.errors import UserError
from strategies.runtime.batch import BatchWork
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.sim.cost import CostModel
from strategies.runtime.sim.profile import DeviceProfile


def _works(it: pd.DataFrame) -> list[BatchWork]:
    """Each recorded iteration's batch, in cost-model units (runs recorded before the context split
    was kept count as generation only)."""
    it = it.assign(**{c: it.get(c, 0)
                      for c in ("num_context_tokens", "context_kv_read_tokens", "context_attention_pairs")})
    return [BatchWork(int(r.num_tokens), int(r.num_samples), int(r.kv_read_tokens), int(r.attention_pairs),
                      int(r.num_context_tokens), int(r.context_kv_read_tokens), int(r.context_attention_pairs))
            for r in it.itertuples(index=False)]


def _fit(y: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, rows: np.ndarray, peak: float, bw: float,
         ef_grid: np.ndarray, eb_grid: np.ndarray) -> tuple[float, float, float, float, float]:
    """Per-kernel rooflines + overhead + per-row cost: the grid picks the efficiencies, least squares the
    rest. flops, nbytes [N, kernel kinds]."""
    ef, eb = np.meshgrid(ef_grid, eb_grid, indexing="ij")
    ef, eb = ef.ravel()[:, None], eb.ravel()[:, None]  # [G, 1]
    pred = np.zeros((len(ef), len(y)))  # [G, N]
    for c in range(flops.shape[1]):
        pred += np.maximum(flops[None, :, c] / (peak * ef), nbytes[None, :, c] / (bw * eb))
    x = np.c_[np.ones_like(y), rows]  # [N, 2]
    beta = (y[None] - pred) @ np.linalg.pinv(x).T  # [G, 2]: overhead, per-row cost
    beta = np.maximum(beta, 0.0)
    sse = ((pred + beta @ x.T - y[None]) ** 2).sum(axis=1)
    best = int(np.argmin(sse))
    return float(ef[best, 0]), float(eb[best, 0]), float(beta[best, 0]), float(beta[best, 1]), float(sse[best])


def _fit_sum(y: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, rows: np.ndarray, peak: float,
             bw: float) -> tuple[float, float, float, float, float] | None:
    """y ≈ a·FLOPs + b·bytes + c + d·rows with every coefficient >= 0 and sane efficiencies, else None."""
    x = np.c_[flops, nbytes, np.ones_like(y), rows]
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b, c, d = coef
    if a <= 0 or b <= 0 or c < 0 or d < 0:
        return None
    ef, eb = 1 / (a * peak), 1 / (b * bw)
    if not (0 < ef <= 1.5 and 0 < eb <= 1.5):
        return None
    sse = float(((x @ coef - y) ** 2).sum())
    return float(ef), float(eb), float(c), float(d), sse


def _latencies(frames: list[pd.DataFrame]) -> tuple[float, float]:
    """Medians, per strategy's records: device start after max(launch, previous end); host seeing a
    finished step it was blocked on (postprocess start after the device's end)."""
    launch, sync = [], []
    for it in frames:
        it = it.dropna(subset=["forward_start_s", "sample_end_s", "launch_s"])
        ready = np.maximum(it["launch_s"].to_numpy(), it["sample_end_s"].shift(1).fillna(0).to_numpy())
        launch.append(it["forward_start_s"].to_numpy() - ready)
        blocked = it[it["wait_s"] > 0]
        sync.append((blocked["postprocess_start_s"] - blocked["sample_end_s"]).to_numpy())
    med = [float(np.median(np.concatenate(x))) if any(len(a) for a in x) else 0.0 for x in (launch, sync)]
    return max(med[0], 0.0), max(med[1], 0.0)


def calibrate(run_dir: Path, gpu: str = "cpu") -> tuple[DeviceProfile, dict]:
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except OSError:
        raise UserError(f"{run_dir}: not a run directory (no run.json)") from None
    if meta.get("device") == "sim":
        raise UserError(f"{run_dir}: a simulated run; calibrate on a real one")
    spec = ModelConfig(**meta["model"])
    base = DeviceProfile.for_gpu(gpu)
    cost = CostModel(spec, base, 1)
    frames = [pd.read_parquet(p) for p in sorted(run_dir.glob("*/iterations.parquet"))]
    it = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    it = it.dropna(subset=["forward_start_s", "sample_end_s"])
    if len(it) < 10:
        raise UserError(f"{run_dir}: too few complete iterations to calibrate ({len(it)})")
    y = (it["sample_end_s"] - it["forward_start_s"]).to_numpy()
    works = _works(it)
    terms = [cost.terms(w) for w in works]
    flops = np.array([[t.flops * t.count for t in ts] for ts in terms])  # [N, kernel kinds]
    nbytes = np.array([[t.bytes * t.count for t in ts] for ts in terms])  # [N, kernel kinds]
    rows = it["num_samples"].to_numpy(dtype=float)
    grid = np.geomspace(1e-4, 1.5, 60)
    peak, bw = base.gpu.peak_flops, base.gpu.mem_bw
    ef, eb, *_ = _fit(y, flops, nbytes, rows, peak, bw, grid, grid)
    ef, eb, overhead, per_row, sse = _fit(y, flops, nbytes, rows, peak, bw,
                                          np.geomspace(ef / 1.3, min(ef * 1.3, 1.5), 31),
                                          np.geomspace(eb / 1.3, min(eb * 1.3, 1.5), 31))
    combine = "max"
    additive = _fit_sum(y, flops.sum(axis=1), nbytes.sum(axis=1), rows, peak, bw)
    if additive is not None and additive[4] < sse:
        ef, eb, overhead, per_row, sse = additive
        combine = "sum"
    launch, sync = _latencies(frames)
    profile = replace(base, eff_flops=ef, eff_bw=eb, attn_eff_flops=ef, elem_eff_bw=eb, overhead_s=overhead,
                      row_overhead_s=per_row,
                      launch_latency_s=launch, sync_latency_s=sync, combine=combine, source=str(run_dir))
    fitted = CostModel(spec, profile, 1)
    pred = np.array([fitted.step_time(w) for w in works])
    stats = {"iterations": len(it), "combine": combine, "eff_flops": ef, "eff_bw": eb, "overhead_ms": overhead * 1e3,
             "row_overhead_ms": per_row * 1e3,
             "launch_latency_ms": launch * 1e3, "sync_latency_ms": sync * 1e3,
             "mape": float(np.mean(np.abs(pred - y) / y)), "total_error": float(pred.sum() / y.sum() - 1),
             "r2": float(1 - sse / ((y - y.mean()) ** 2).sum())}
    return profile, stats
