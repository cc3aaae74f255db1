"""Vidur's attention tables (``*attention*.csv``) for ``slotbench calibrate --op-profile``: load, price, fit.

A row is one layer's attention kernel on one rank: decode (``is_prefill`` false: ``batch_size`` rows with
``kv_cache_size`` cached tokens each, ``time_stats.attn_decode.median``) or prefill (one
``prefill_chunk_size``-token chunk after ``kv_cache_size`` cached tokens, ``time_stats.attn_prefill.median``);
times in ms. ``n_q_head``/``n_kv_head`` are the model's, split over ``num_tensor_parallel_workers``. Each row
is priced by the cost model's own attention functions (sim/attention.py) plus the kernel's launch. The
four decode parameters (the launch among them: decode rows are the small kernels) and the three prefill
ones are fitted by a coordinate search that minimises the mean |predicted / measured - 1| over at most
``MAX_ROWS`` rows of each kind (Vidur's tables hold ~40,000).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from harness.errors import UserError
from strategies.runtime.sim.attention import decode_attention_s, prefill_attention_s
from strategies.runtime.sim.profile import DeviceProfile

COLUMNS = ["n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size", "prefill_chunk_size",
           "kv_cache_size", "is_prefill"]
DECODE = ("attn_eff_bw", "attn_block_bw", "attn_block_s", "attn_kernel_s")
PREFILL = ("attn_eff_flops", "prefill_block_flops", "prefill_block_s")
MAX_ROWS = 1500  # per kind: a seeded sample keeps the fit to seconds
INFERSIM_NAME = re.compile(r"(\d+)-(\d+)-(\d+)(?:-tp(\d+))?")


def read_table(path: Path, columns: Sequence[str], what: str) -> pd.DataFrame:
    """A CSV that must hold ``columns``: else one line saying which (``what``: the table's kind)."""
    try:
        t = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable CSV ({exc})") from None
    if missing := sorted(set(columns) - set(t.columns)):
        raise UserError(f"{path}: the {what} table lacks {missing}")
    return t


def load_attention(paths: list[Path]) -> pd.DataFrame:
    """Rows (kind, batch, chunk, kv, heads, kv_heads, head_dim, measured_s) from Vidur attention tables."""
    frames = []
    for path in paths:
        t = read_table(path, COLUMNS, "attention")
        prefill = t["is_prefill"].astype(str).str.lower() == "true"
        measured = np.where(prefill, t.get("time_stats.attn_prefill.median", np.nan),
                            t.get("time_stats.attn_decode.median", np.nan))
        tp = t["num_tensor_parallel_workers"]
        frames.append(pd.DataFrame({
            "kind": np.where(prefill, "prefill", "decode"), "batch": t["batch_size"], "chunk": t["prefill_chunk_size"],
            "kv": t["kv_cache_size"], "heads": np.maximum(t["n_q_head"] // tp, 1),
            "kv_heads": np.maximum(t["n_kv_head"] // tp, 1), "head_dim": t["n_embd"] // t["n_q_head"],
            "measured_s": np.asarray(measured, float) / 1e3}))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["kind", "measured_s"])
    return rows[rows["measured_s"] > 0].reset_index(drop=True)


def predict_attention(rows: pd.DataFrame, p: DeviceProfile, dtype_bytes: int) -> np.ndarray:
    """Modelled seconds of each row: what a simulated step charges it (a row at position kv reads kv + 1
    entries and writes one; a chunk's keys are its cached tokens and itself), plus the kernel's launch."""
    out = np.empty(len(rows))
    for i, r in enumerate(rows.itertuples(index=False)):
        if r.kind == "prefill":
            out[i] = prefill_attention_s(p, [(r.chunk, r.kv + r.chunk)], r.heads, r.head_dim)
        else:
            out[i] = decode_attention_s(p, r.batch, r.batch * (r.kv + 2), r.kv_heads, r.head_dim, dtype_bytes)
    return out + p.attn_kernel_s


def _error(rows: pd.DataFrame, p: DeviceProfile, dtype_bytes: int) -> float:
    return float(np.mean(np.abs(predict_attention(rows, p, dtype_bytes) / rows["measured_s"].to_numpy() - 1)))


INFERSIM_COLUMNS = {"prefill": ("seq_len", "latency_us"), "decode": ("batch_size", "kv_len", "latency_us")}


def load_infersim(directory: Path, kind: str) -> pd.DataFrame:
    """Rows from InferSim's attention tables (alibaba/InferSim's kernel_benchmark scripts; inference-sim publishes
    the H100's under ``bench_data/mha/{prefill,decode}/h100/``): a file per head shape,
    ``<query heads>-<KV heads>-<head dim>[-tp<N>].csv``, times in µs. ``prefill``: a causal cold prompt of
    ``seq_len`` tokens a row (FlashAttention-3's varlen kernel); ``decode``: ``batch_size`` sequences of ``kv_len``
    KV entries each (FlashInfer's), the heads split over the file's TP degree."""
    frames = []
    for path in sorted(directory.glob("*.csv")):
        if not (m := INFERSIM_NAME.fullmatch(path.stem)):
            continue
        heads, kv_heads, head_dim, tp = (int(x) for x in (*m.groups()[:3], m.group(4) or 1))
        t = read_table(path, INFERSIM_COLUMNS[kind], kind)
        prefill = kind == "prefill"
        frames.append(pd.DataFrame({
            "kind": kind, "batch": 1 if prefill else t["batch_size"], "chunk": t["seq_len"] if prefill else 0,
            # a decode row at position kv reads kv + 1 entries and writes one (predict_attention): kv_len in all
            "kv": 0 if prefill else t["kv_len"] - 2, "heads": max(heads // tp, 1), "kv_heads": max(kv_heads // tp, 1),
            "head_dim": head_dim, "shape": path.stem, "measured_s": t["latency_us"] / 1e6}))
    if not frames:
        raise UserError(f"{directory}: no <heads>-<KV heads>-<head dim>[-tp<N>].csv {kind} tables")
    return pd.concat(frames, ignore_index=True)


def fit_attention(rows: pd.DataFrame, p: DeviceProfile, dtype_bytes: int,
                  prefill: tuple[str, ...] = PREFILL) -> DeviceProfile:
    """``p`` with its decode and prefill attention parameters fitted to ``rows`` (each kind on its own);
    ``prefill`` names the prefill parameters the fit may move (the rest stay ``p``'s)."""
    for kind, names in (("decode", DECODE), ("prefill", prefill)):
        sample = rows[rows["kind"] == kind]
        if sample.empty:
            continue
        if len(sample) > MAX_ROWS:
            sample = sample.sample(MAX_ROWS, random_state=0)
        best, step = _error(sample, p, dtype_bytes), 0.3
        while step > 1e-3:  # multiply one parameter at a time by 1 ± step; halve the step when none helps
            moved = False
            for name in names:
                for factor in (1 + step, 1 - step):
                    value = getattr(p, name) * factor
                    if not name.endswith("_s") and value > 1:  # no kernel beats its GPU's peak
                        continue
                    q = replace(p, **{name: value})
                    if (err := _error(sample, q, dtype_bytes)) < best:
                        p, best, moved = q, err, True
            if not moved:
                step /= 2
    return p
