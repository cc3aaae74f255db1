"""``slotbench calibrate --op-profile DIR``: fit a device profile to measured per-operator kernel times.

Reads the per-operator tables Microsoft's Vidur publishes (``data/profiling/compute/<gpu>/<model>/``,
``data/profiling/network/<node>/``): ``*mlp*.csv`` (every non-attention operator of one layer by
``num_tokens`` and ``num_tensor_parallel_workers``; median times in ms) and ``*all_reduce*.csv`` /
``*all-reduce*.csv`` (NCCL all-reduce by message ``size`` in bytes and ``num_workers``; rows spanning
more than one node, ``num_workers > devices_per_node``, are left out: tensor parallelism stays in a node).

Each measured kernel is priced with the cost model's own kernel functions (``gemm_work``,
``elementwise_bytes``, ``ring_allreduce_bytes``), so what is fitted is what a simulated step sums.
Every fit minimises the mean absolute relative error (a robust fit: the tables' small kernels are
timed to a microsecond, and small all-reduces scatter 2-5x), with each latency in closed form as the
median of (measured - modelled) weighted by 1 / measured:

- GEMMs: roofline max(FLOPs / (peak × eff_flops), bytes / (bandwidth × eff_bw)), or its smooth form
  (c^k + m^k)^(1/k) for k in 4, 2, 1.5, + gemm_kernel_s; the efficiencies on a log grid refined once; the
  combination that fits best then prices every kernel of a simulated step.
- element-wise kernels and the embedding gather, each on its own: latency (``elem_kernel_s[op]``) +
  bytes / (bandwidth × ``elem_eff_bw[op]``), the bytes past half the L2 costing 1 + ``elem_spill[op]``;
  ``kernel_s`` (the KV write's launch) becomes their median.
- attention (``*attention*.csv``): the decode and prefill thread-block parameters
  (harness/calibrate/attention_profile.py).
- the measured GEMMs themselves, by shape (``gemm_table``; strategies/runtime/sim/gemm_table.py): a
  simulated GEMM of a shape the tables measured costs what they measured at the next token count up.
  Its error is reported on counts it lacks: a table of every other count pricing the rest.
- all-reduce: latency + ring bytes / (link bandwidth × link efficiency), for each GPU count in the table
  (``allreduce_by_workers``: NCCL picks its algorithm by communicator size) and for all of them together
  (``allreduce_latency_s``, ``link_eff``: any other count).

The datasheet's peaks stay; its efficiencies and latencies are replaced. The median relative error per
class (linear, elementwise, all_reduce, attention_decode, attention_prefill: those the tables have) is
returned for the datasheet profile and for the fitted one without its GEMM table (which would price its
own rows exactly): what a shape the tables lack gets.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from harness.calibrate.attention_profile import DECODE, PREFILL, fit_attention, load_attention, predict_attention
from harness.errors import UserError
from strategies.runtime.models.config import DTYPE_BYTES
from strategies.runtime.sim.gemm_table import GemmTable, gemm_key
from strategies.runtime.sim.kernels import GEMMS, elementwise_bytes, gemm_work, ring_allreduce_bytes
from strategies.runtime.sim.profile import ELEM_EFF_DEFAULTS, DeviceProfile, spilled_bytes
from strategies.runtime.sim.specs import GpuSpec

SHAPE_COLUMNS = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tokens", "num_tensor_parallel_workers"]
GEMM_GROUP = ["op", "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "tp"]  # one GEMM shape of one table


def _shapes(r: tuple) -> tuple[int, int, int, int]:
    """(hidden, query width, KV width, intermediate) of a table row: what GEMMS and ELEMENTWISE take."""
    head_dim = r.n_embd // r.n_head
    return r.n_embd, r.n_head * head_dim, r.n_kv_head * head_dim, r.n_expanded_embd


def _read(paths: list[Path]) -> pd.DataFrame:
    frames = []
    for p in paths:
        try:
            frames.append(pd.read_csv(p))
        except (OSError, ValueError) as exc:
            raise UserError(f"{p}: not a readable CSV ({exc})") from None
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def load_op_tables(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Long tables from a directory of Vidur CSVs: kernels (op, kind, shapes, tokens, tp, measured_s)
    and all-reduces (workers, bytes, measured_s)."""
    if not directory.is_dir():
        raise UserError(f"--op-profile {directory}: not a directory")
    mlp = _read(sorted(directory.glob("*mlp*.csv")))
    ar = _read(sorted({*directory.glob("*all_reduce*.csv"), *directory.glob("*all-reduce*.csv")}))
    if mlp.empty and ar.empty and not any(directory.glob("*attention*.csv")):
        raise UserError(f"--op-profile {directory}: no Vidur tables (*mlp.csv, *attention.csv, *all_reduce.csv) "
                        "in it")
    parts = []
    if not mlp.empty:
        if missing := sorted(set(SHAPE_COLUMNS) - set(mlp.columns)):
            raise UserError(f"--op-profile {directory}: the mlp table lacks {missing}")
        for op in [*GEMMS, *ELEM_EFF_DEFAULTS]:
            col = f"time_stats.{op}.median"
            if col in mlp:
                part = mlp[[*SHAPE_COLUMNS, col]].dropna().rename(
                    columns={col: "measured_ms", "num_tensor_parallel_workers": "tp"})
                parts.append(part.assign(op=op, kind="linear" if op in GEMMS else "elementwise"))
    ops = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["op", "kind", "measured_s"])
    if parts:
        ops["measured_s"] = ops.pop("measured_ms") / 1e3
        ops = ops[ops["measured_s"] > 0].reset_index(drop=True)
    all_reduce = pd.DataFrame(columns=["workers", "bytes", "measured_s"])
    if not ar.empty:
        col = "time_stats.all_reduce.median"
        if not {col, "num_workers", "size"} <= set(ar.columns):
            raise UserError(f"--op-profile {directory}: the all-reduce table lacks {col}, num_workers or size")
        if "devices_per_node" in ar:  # tensor parallelism stays inside one node: drop the multi-node rows
            ar = ar[ar["num_workers"] <= ar["devices_per_node"]]
        all_reduce = pd.DataFrame({"workers": ar["num_workers"], "bytes": ar["size"], "measured_s": ar[col] / 1e3})
        all_reduce = all_reduce.groupby(["workers", "bytes"], as_index=False)["measured_s"].median()
        all_reduce = all_reduce[(all_reduce["measured_s"] > 0) & (all_reduce["workers"] > 1)]
    return ops, all_reduce.reset_index(drop=True)


def kernel_work(ops: pd.DataFrame, dtype_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs and bytes of every kernel row on one rank, by the step model's functions."""
    flops, nbytes = np.zeros(len(ops)), np.zeros(len(ops))
    for i, r in enumerate(ops.itertuples(index=False)):
        shapes = _shapes(r)
        if r.op in GEMMS:
            flops[i], nbytes[i] = gemm_work(r.num_tokens, *GEMMS[r.op](*shapes), r.tp, dtype_bytes)
        else:
            nbytes[i] = elementwise_bytes(r.op, r.num_tokens, shapes, r.tp, dtype_bytes)
    return flops, nbytes


def predict_kernels(ops: pd.DataFrame, p: DeviceProfile, nbytes: np.ndarray, dtype_bytes: int) -> np.ndarray:
    """Modelled seconds of every kernel row under ``p`` (``nbytes``: their bytes, by ``kernel_work``), by
    the functions a simulated step calls (``gemm_s``, ``elem_s``)."""
    return np.array([p.gemm_s(r.op, r.num_tokens, *GEMMS[r.op](*_shapes(r)), r.tp, dtype_bytes) if r.op in GEMMS
                     else p.elem_s(r.op, b) for r, b in zip(ops.itertuples(index=False), nbytes, strict=True)])


def predict_all_reduce(all_reduce: pd.DataFrame, p: DeviceProfile) -> np.ndarray:
    return np.array([p.allreduce_s(b, int(n)) for n, b in zip(all_reduce["workers"], all_reduce["bytes"], strict=True)])


def gemm_table(ops: pd.DataFrame, dtype_bytes: int) -> GemmTable:
    """The tables' GEMM rows by shape (sim/gemm_table.py): each shape's median time at each token count."""
    table = {}
    for _, part in ops[ops["op"].isin(GEMMS)].groupby(GEMM_GROUP):
        r = next(part.itertuples(index=False))
        curve = part.groupby("num_tokens")["measured_s"].median()
        table[gemm_key(r.op, *GEMMS[r.op](*_shapes(r)), int(r.tp), dtype_bytes)] = [
            [int(t) for t in curve.index], [float(v) for v in curve]]
    return table


def heldout_table_errors(ops: pd.DataFrame, p: DeviceProfile, dtype_bytes: int) -> dict[str, float]:
    """How well the GEMM table prices token counts it lacks: a table of every other count of each shape
    (the first, the third, ...: on Vidur's grid the multiples of 16, 32 past 1,024 and 64 past 2,048
    tokens) prices the counts between. Median and 90th percentile of |predicted / measured - 1|."""
    gemms = ops[ops["op"].isin(GEMMS)]
    rank = gemms.groupby(GEMM_GROUP)["num_tokens"].rank(method="dense").to_numpy(int)
    train, test = gemms[rank % 2 == 1], gemms[rank % 2 == 0]
    half = replace(p, gemm_table=gemm_table(train, dtype_bytes))
    rel = np.abs(predict_kernels(test, half, np.zeros(len(test)), dtype_bytes) / test["measured_s"].to_numpy(float) - 1)
    return {"heldout_median_error": float(np.median(rel)), "heldout_p90_error": float(np.percentile(rel, 90))}


def errors_by_class(ops: pd.DataFrame, all_reduce: pd.DataFrame, op_pred: np.ndarray,
                    ar_pred: np.ndarray) -> dict[str, float]:
    """Median |predicted / measured - 1| per class: linear, elementwise, all_reduce."""
    out = {}
    rel = np.abs(op_pred / ops["measured_s"].to_numpy(float) - 1) if len(ops) else np.zeros(0)
    for kind in ("linear", "elementwise"):
        mask = (ops["kind"] == kind).to_numpy()
        if mask.any():
            out[kind] = float(np.median(rel[mask]))
    if len(all_reduce):
        out["all_reduce"] = float(np.median(np.abs(ar_pred / all_reduce["measured_s"].to_numpy(float) - 1)))
    return out


def _latency_l1(model: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``model`` [G, N] (kernel times before a constant latency), the latency >= 0 that
    minimises the mean |(model + latency) / y - 1| (the median of y - model weighted by 1 / y), and that
    mean [G]."""
    gap = y[None, :] - model  # [G, N]
    order = np.argsort(gap, axis=1)
    gap = np.take_along_axis(gap, order, axis=1)
    cum = np.cumsum((1 / y)[order], axis=1)  # [G, N]
    at = (cum < cum[:, -1:] / 2).sum(axis=1)  # [G] where the weight passes half: the weighted median
    lat = np.maximum(gap[np.arange(len(gap)), at], 0.0)
    return lat, np.abs((model + lat[:, None]) / y - 1).mean(axis=1)


def _fit_bandwidth(nbytes: np.ndarray, y: np.ndarray, bandwidth: float) -> tuple[float, float, float]:
    """(efficiency, latency, mean error) of latency + nbytes / (bandwidth × efficiency): a log grid refined
    once."""
    grid = np.geomspace(0.02, 1.5, 120)
    for _ in range(2):
        lat, err = _latency_l1(nbytes[None, :] / (bandwidth * grid[:, None]), y)
        i = int(np.argmin(err))
        best = (float(grid[i]), float(lat[i]), float(err[i]))
        grid = np.geomspace(grid[i] / 1.05, min(grid[i] * 1.05, 1.5), 60)
    return best


def _fit_elementwise(nbytes: np.ndarray, y: np.ndarray, gpu: GpuSpec) -> tuple[float, float, float]:
    """(efficiency, latency, spill) of one element-wise kernel: ``_fit_bandwidth`` at each spill in
    0-2 (steps of 0.1; one, 0, where the GPU has no L2 figure), the best kept."""
    spills = np.linspace(0.0, 2.0, 21) if gpu.l2_bytes else np.zeros(1)
    fits = []
    for spill in spills:
        moved = np.array([spilled_bytes(b, float(spill), gpu.l2_bytes) for b in nbytes])
        fits.append((*_fit_bandwidth(moved, y, gpu.mem_bw), float(spill)))
    eff, lat, _, spill = min(fits, key=lambda f: f[2])
    return eff, lat, spill


def _fit_gemms(flops: np.ndarray, nbytes: np.ndarray, y: np.ndarray, p: DeviceProfile) -> dict:
    """Efficiencies, latency and how compute and memory combine near the ridge (max, or smooth with
    exponent k)."""
    best: tuple = (np.inf,)
    for combine, k in (("max", p.ridge_k), ("smooth", 4.0), ("smooth", 2.0), ("smooth", 1.5)):
        grids = (np.geomspace(0.05, 1.5, 40),) * 2
        for _ in range(2):  # a coarse grid, then a fine one around its best
            ef, eb = (a.ravel()[:, None] for a in np.meshgrid(*grids, indexing="ij"))  # [G, 1]
            c, m = flops[None] / (p.gpu.peak_flops * ef), nbytes[None] / (p.gpu.mem_bw * eb)  # [G, N]
            lat, err = _latency_l1(np.maximum(c, m) if combine == "max" else (c**k + m**k) ** (1 / k), y)
            i = int(np.argmin(err))
            if err[i] < best[0]:
                best = (float(err[i]), float(ef[i, 0]), float(eb[i, 0]), float(lat[i]), combine, k)
            grids = (np.geomspace(ef[i, 0] / 1.2, min(ef[i, 0] * 1.2, 1.5), 25),
                     np.geomspace(eb[i, 0] / 1.2, min(eb[i, 0] * 1.2, 1.5), 25))
    return {"eff_flops": best[1], "eff_bw": best[2], "gemm_kernel_s": best[3], "combine": best[4], "ridge_k": best[5]}


def fit_op_profile(directory: Path, gpu: str, dtype: str = "float16") -> tuple[DeviceProfile, dict]:
    """A device profile for ``gpu`` fitted to the Vidur tables in ``directory``, and the fit's errors."""
    if gpu == "cpu":
        raise UserError("--op-profile: say which GPU the tables were measured on (--gpu a100, h100, ...)")
    try:
        base = DeviceProfile.for_gpu(gpu)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    ops, ar = load_op_tables(directory)
    fit, dtype_bytes = base, DTYPE_BYTES[dtype]
    flops, nbytes = kernel_work(ops, dtype_bytes)  # priced once, by every profile below
    if len(ops):
        y = ops["measured_s"].to_numpy(float)
        gemm = ops["op"].isin(GEMMS).to_numpy()
        if gemm.any():
            fit = replace(fit, **_fit_gemms(flops[gemm], nbytes[gemm], y[gemm], base),
                          gemm_table=gemm_table(ops, dtype_bytes))
        if (~gemm).any():
            effs, lats = dict(base.elem_eff_bw), dict.fromkeys(ELEM_EFF_DEFAULTS, base.kernel_s)
            spills = dict(base.elem_spill)
            for op in ELEM_EFF_DEFAULTS:
                rows = (ops["op"] == op).to_numpy()
                if rows.any():
                    effs[op], lats[op], spills[op] = _fit_elementwise(nbytes[rows], y[rows], base.gpu)
            fit = replace(fit, elem_eff_bw=effs, elem_kernel_s=lats, elem_spill=spills,
                          kernel_s=float(np.median(list(lats.values()))))
    if len(ar):
        ring = np.array([ring_allreduce_bytes(nb, int(n)) for n, nb in zip(ar["workers"], ar["bytes"], strict=True)])
        y, workers = ar["measured_s"].to_numpy(float), ar["workers"].to_numpy()
        eff, lat, _ = _fit_bandwidth(ring, y, base.gpu.link_bw)
        by_workers = {}
        for n in np.unique(workers):
            e, t, _ = _fit_bandwidth(ring[workers == n], y[workers == n], base.gpu.link_bw)
            by_workers[str(int(n))] = [t, e]
        fit = replace(fit, allreduce_latency_s=lat, link_eff=eff, allreduce_by_workers=by_workers)
    attention = load_attention(sorted(directory.glob("*attention*.csv")))
    if len(attention):  # Vidur's kernel prices a chunk's tiles at its last one's keys (sim/attention.py)
        fit = fit_attention(attention, replace(fit, prefill_causal=False), dtype_bytes)
    fit = replace(fit, source=f"op-profile:{directory}")
    errors = {}  # the fitted profile's without its GEMM table, which prices its own rows exactly
    for name, p in (("datasheet", base), ("fitted", replace(fit, gemm_table=None))):
        errors[name] = errors_by_class(ops, ar, predict_kernels(ops, p, nbytes, dtype_bytes), predict_all_reduce(ar, p))
        rel = np.abs(predict_attention(attention, p, dtype_bytes) / attention["measured_s"].to_numpy() - 1)
        for kind in ("decode", "prefill"):
            if (mask := (attention["kind"] == kind).to_numpy()).any():
                errors[name][f"attention_{kind}"] = float(np.median(rel[mask]))
    stats = {"rows": {"kernels": len(ops), "all_reduce": len(ar), "attention": len(attention)},
             "median_error_datasheet": errors["datasheet"], "median_error_fitted": errors["fitted"],
             "fitted": {"eff_flops": fit.eff_flops, "eff_bw": fit.eff_bw, "gemm_kernel_us": fit.gemm_kernel_s * 1e6,
                        "combine": fit.combine, "ridge_k": fit.ridge_k,
                        "kernel_us": fit.kernel_s * 1e6, "elem_eff_bw": fit.elem_eff_bw, "elem_spill": fit.elem_spill,
                        "elem_kernel_us": {op: v * 1e6 for op, v in (fit.elem_kernel_s or {}).items()},
                        "allreduce_latency_us": fit.allreduce_latency_s * 1e6, "link_eff": fit.link_eff,
                        "allreduce_by_workers": {n: {"latency_us": t * 1e6, "link_eff": e}
                                                 for n, (t, e) in (fit.allreduce_by_workers or {}).items()},
                        **{name: getattr(fit, name) for name in (*DECODE, *PREFILL)}}}
    if fit.gemm_table:
        stats["gemm_table"] = {"shapes": len(fit.gemm_table), **heldout_table_errors(ops, fit, dtype_bytes)}
    return fit, stats
