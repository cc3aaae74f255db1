"""``slotbench calibrate --op-profile DIR``: fit a device profile to measured per-operator kernel times.

Reads the per-operator tables Microsoft's Vidur publishes (``data/profiling/compute/<gpu>/<model>/``,
``data/profiling/network/<node>/``): ``*mlp*.csv`` (every non-attention operator of one layer by
``num_tokens`` and ``num_tensor_parallel_workers``; median times in ms) and ``*all_reduce*.csv`` /
``*all-reduce*.csv`` (NCCL all-reduce by message ``size`` in bytes and ``num_workers``; rows spanning
more than one node, ``num_workers > devices_per_node``, are left out: tensor parallelism stays in a node).

Each measured kernel is priced with the cost model's own kernel functions (``gemm_work``,
``elementwise_bytes``, ``ring_allreduce_bytes``), so what is fitted is what a simulated step sums:

- GEMMs: roofline max(FLOPs / (peak × eff_flops), bytes / (bandwidth × eff_bw)), or its smooth form
  (c^k + m^k)^(1/k) for k in 4, 2, 1.5, + gemm_kernel_s; the efficiencies on a log grid refined once, the
  latency in closed form, the combination that fits best, minimising squared relative error. The
  combination then prices every kernel of a simulated step.
- element-wise kernels and the embedding gather: kernel_s (shared) + bytes / (bandwidth × eff) with one
  efficiency per kernel, by linear least squares on relative error.
- all-reduce: allreduce_latency_s + ring bytes / (link bandwidth × link_eff), the same way.

The datasheet's peaks stay; its efficiencies and latencies are replaced. The median relative error per
class (linear, elementwise, all_reduce) is returned for the datasheet profile and for the fitted one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from harness.errors import UserError
from strategies.runtime.sim.cost import (
    DTYPE_BYTES,
    ELEM_EFF_DEFAULTS,
    GEMMS,
    DeviceProfile,
    elementwise_bytes,
    gemm_work,
    ring_allreduce_bytes,
)

SHAPE_COLUMNS = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tokens", "num_tensor_parallel_workers"]


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
    if mlp.empty and ar.empty:
        raise UserError(f"--op-profile {directory}: no Vidur tables (*mlp.csv, *all_reduce.csv) in it")
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
        head_dim = r.n_embd // r.n_head
        shapes = (r.n_embd, r.n_head * head_dim, r.n_kv_head * head_dim, r.n_expanded_embd)
        if r.op in GEMMS:
            flops[i], nbytes[i] = gemm_work(r.num_tokens, *GEMMS[r.op](*shapes), r.tp, dtype_bytes)
        else:
            nbytes[i] = elementwise_bytes(r.op, r.num_tokens, shapes, r.tp, dtype_bytes)
    return flops, nbytes


def predict(ops: pd.DataFrame, all_reduce: pd.DataFrame, p: DeviceProfile,
            work: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Modelled seconds of every kernel row (``work``: their ``kernel_work``) and every all-reduce row
    under ``p``."""
    flops, nbytes = work
    op_pred = np.array([p.roofline(f, b, p.eff_flops, p.eff_bw) + p.gemm_kernel_s if op in GEMMS
                        else b / (p.gpu.mem_bw * p.elem_eff_bw[op]) + p.kernel_s
                        for op, f, b in zip(ops["op"], flops, nbytes, strict=True)])
    ring = np.array([ring_allreduce_bytes(b, int(n)) for n, b in zip(all_reduce["workers"], all_reduce["bytes"],
                                                                      strict=True)])
    return op_pred, p.allreduce_latency_s + ring / (p.gpu.link_bw * p.link_eff)


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


def _relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative c minimising sum((x @ c / y - 1)^2); a negative coefficient is dropped and refitted."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep], *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones_like(y), rcond=None)
        if (coef >= 0).all() or not keep.any():
            return np.maximum(coef, 0.0)
        keep &= coef >= 0


def _fit_gemms(flops: np.ndarray, nbytes: np.ndarray, y: np.ndarray, p: DeviceProfile) -> dict:
    """Efficiencies, latency and how compute and memory combine near the ridge (max, or smooth with
    exponent k), minimising the squared relative error."""
    best: tuple = (np.inf,)
    for combine, k in (("max", p.ridge_k), ("smooth", 4.0), ("smooth", 2.0), ("smooth", 1.5)):
        grids = (np.geomspace(0.05, 1.5, 60),) * 2
        here: tuple = (np.inf,)
        for _ in range(2):  # a coarse grid, then a fine one around its best
            ef, eb = (a.ravel()[:, None] for a in np.meshgrid(*grids, indexing="ij"))  # [G, 1]
            c, m = flops[None] / (p.gpu.peak_flops * ef), nbytes[None] / (p.gpu.mem_bw * eb)  # [G, N]
            roof = np.maximum(c, m) if combine == "max" else (c**k + m**k) ** (1 / k)
            # the latency that minimises the relative error for each grid point, in closed form
            lat = np.maximum(((1 - roof / y) / y).sum(axis=1) / (1 / y**2).sum(), 0.0)  # [G]
            sse = (((roof + lat[:, None]) / y - 1) ** 2).sum(axis=1)
            i = int(np.argmin(sse))
            if sse[i] < here[0]:
                here = (float(sse[i]), float(ef[i, 0]), float(eb[i, 0]), float(lat[i]))
            grids = (np.geomspace(here[1] / 1.2, min(here[1] * 1.2, 1.5), 41),
                     np.geomspace(here[2] / 1.2, min(here[2] * 1.2, 1.5), 41))
        if here[0] < best[0]:
            best = (*here, combine, k)
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
    fit = base
    flops, nbytes = work = kernel_work(ops, DTYPE_BYTES[dtype])  # priced once, by every profile below
    if len(ops):
        y = ops["measured_s"].to_numpy(float)
        gemm = ops["op"].isin(GEMMS).to_numpy()
        if gemm.any():
            fit = replace(fit, **_fit_gemms(flops[gemm], nbytes[gemm], y[gemm], base))
        if (~gemm).any():
            elem = ops.loc[~gemm, "op"].to_numpy()
            names = [op for op in ELEM_EFF_DEFAULTS if (elem == op).any()]
            x = np.c_[np.ones(len(elem)), *[(elem == op) * nbytes[~gemm] / base.gpu.mem_bw for op in names]]
            coef = _relative_lstsq(x, y[~gemm])
            effs = {**base.elem_eff_bw, **{op: min(1.5, 1 / c) for op, c in zip(names, coef[1:], strict=True) if c}}
            fit = replace(fit, kernel_s=float(coef[0]), elem_eff_bw=effs)
    if len(ar):
        ring = np.array([ring_allreduce_bytes(nb, int(n)) for n, nb in zip(ar["workers"], ar["bytes"], strict=True)])
        lat, inv = _relative_lstsq(np.c_[np.ones(len(ar)), ring / base.gpu.link_bw], ar["measured_s"].to_numpy(float))
        fit = replace(fit, allreduce_latency_s=float(lat), link_eff=min(1.5, 1 / inv) if inv else 1.5)
    fit = replace(fit, source=f"op-profile:{directory}")
    stats = {"rows": {"kernels": len(ops), "all_reduce": len(ar)},
             "median_error_datasheet": errors_by_class(ops, ar, *predict(ops, ar, base, work)),
             "median_error_fitted": errors_by_class(ops, ar, *predict(ops, ar, fit, work)),
             "fitted": {"eff_flops": fit.eff_flops, "eff_bw": fit.eff_bw, "gemm_kernel_us": fit.gemm_kernel_s * 1e6,
                        "combine": fit.combine, "ridge_k": fit.ridge_k,
                        "kernel_us": fit.kernel_s * 1e6, "elem_eff_bw": fit.elem_eff_bw,
                        "allreduce_latency_us": fit.allreduce_latency_s * 1e6, "link_eff": fit.link_eff}}
    return fit, stats
