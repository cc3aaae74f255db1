"""The field's serving metrics, with vLLM ``bench serve`` definitions and numpy defaults.

TTFT = first_token_s − arrival_s; E2EL = finish_s − arrival_s; TPOT = (E2EL − TTFT) / (output − 1) for
requests with more than one token (request-weighted); ITL = consecutive gaps between a request's streamed
chunks — the tokens a step hands out together share one time and are one chunk — pooled over requests.
duration = last finish − first arrival. Throughputs count completed requests.
prefix_cache_hit_rate = prompt tokens read from the prefix cache / prompt tokens, over completed requests (both
tiers, as vLLM's ``prompt_tokens_by_source`` counts local and external hits together); host_cache_hit_rate = the
share of prompt tokens the host KV tier served (vLLM's external hits, SGLang's ``cache_source=host``).
Std is the population std; percentiles interpolate linearly. Request metrics need only
``requests.parquet`` and ``tokens.jsonl``; engine metrics need only ``iterations.parquet``.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from harness.errors import UserError
from harness.source import UNSENT
from reports.tables import acceptance_by_position
from reports.token_times import TokenTimes

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--metric-percentiles {text!r}: expected numbers like 90,99") from None
    if not values or any(not 0 < p < 100 for p in values):
        raise UserError(f"--metric-percentiles {text!r}: each must be in (0, 100)")
    return values


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """``["ttft:200", "tpot:50"]`` → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    slo = {}
    for item in items:
        m = re.fullmatch(r"\s*(\w+)\s*:\s*([0-9.eE+-]+)\s*", item)
        if not m or m.group(1) not in GOODPUT_METRICS:
            raise UserError(f"--goodput {item!r}: expected METRIC:MS with METRIC in {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(m.group(2))
        except ValueError:
            raise UserError(f"--goodput {item!r}: {m.group(2)!r} is not a number") from None
        if not ms > 0 or not math.isfinite(ms):
            raise UserError(f"--goodput {item!r}: the limit must be a positive number of ms")
        slo[m.group(1)] = ms
    return slo


def percentile_name(p: float) -> str:
    return f"{p:g}".replace(".", "_")


def _stats(name: str, values_ms: np.ndarray, percentiles: tuple[float, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    empty = len(values_ms) == 0
    out[f"mean_{name}_ms"] = float("nan") if empty else float(np.mean(values_ms))
    out[f"median_{name}_ms"] = float("nan") if empty else float(np.median(values_ms))
    out[f"std_{name}_ms"] = float("nan") if empty else float(np.std(values_ms))
    nan = [float("nan")] * len(percentiles)
    # every percentile from one partition of the values (the same numbers as a call each)
    values = nan if empty or not percentiles else np.percentile(values_ms, percentiles).tolist()
    for p, value in zip(percentiles, values, strict=True):
        out[f"p{percentile_name(p)}_{name}_ms"] = value
    return out


def request_metrics(requests: pd.DataFrame, token_times: TokenTimes,
                    percentiles: tuple[float, ...] = (90, 99), goodput: dict[str, float] | None = None) -> dict:
    """vLLM's request metrics of ``requests`` (requests.parquet's columns); ``token_times``: its rows', in
    row order (``TokenTimes.of(tokens, requests["request_id"])``)."""
    finished = (requests["status"] == "finished").to_numpy()
    done = requests[finished]
    out: dict[str, float | int] = {
        "completed": len(done),
        "rejected": int((requests["status"] == "rejected").sum()),
        "failed": int((requests["status"] == "failed").sum()),
        "total_input_tokens": int(done["input_tokens"].sum()),
        "total_output_tokens": int(done["output_tokens"].sum()),
    }
    if "cached_tokens" in done:  # prompt tokens served from the prefix cache, of completed requests' prompts
        prompt = done["input_tokens"].sum()
        out["prefix_cache_hit_rate"] = float(done["cached_tokens"].sum() / prompt) if prompt else float("nan")
        if "host_cached_tokens" in done and done["host_cached_tokens"].any():
            out["host_cache_hit_rate"] = float(done["host_cached_tokens"].sum() / prompt)
    duration = float(done["finish_s"].max() - requests["arrival_s"].min()) if len(done) else float("nan")
    out["duration_s"] = duration
    ok = duration > 0
    out["request_throughput"] = len(done) / duration if ok else float("nan")
    out["output_throughput"] = out["total_output_tokens"] / duration if ok else float("nan")
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration if ok \
        else float("nan")
    ttft = ((done["first_token_s"] - done["arrival_s"]) * 1e3).to_numpy()
    e2el = ((done["finish_s"] - done["arrival_s"]) * 1e3).to_numpy()
    n_out = done["output_tokens"].to_numpy()
    multi = n_out > 1
    tpot = (e2el[multi] - ttft[multi]) / (n_out[multi] - 1)
    itl_all = token_times.chunk_gaps(finished) * 1e3  # one gap per streamed chunk, as vLLM counts ITL
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl_all), ("e2el", e2el)):
        out.update(_stats(name, values, percentiles))
    if "kv_transfer_ms" in done and done["kv_transfer_ms"].notna().any():
        out.update(kv_transfer_metrics(done, percentiles))
    if goodput:
        tpot_all = np.zeros(len(done))  # single-token requests count as TPOT 0, as vLLM does
        tpot_all[multi] = tpot
        good = np.ones(len(done), dtype=bool)
        for metric, limit in goodput.items():
            good &= {"ttft": ttft, "tpot": tpot_all, "e2el": e2el}[metric] <= limit
        out["request_goodput"] = int(good.sum()) / duration if ok else float("nan")
        # of every request sent (a rejected or failed one meets no SLO; a turn whose session ended before it
        # was sent is no request sent): what a capacity search holds to
        sent = int((~requests["finish_reason"].astype(str).str.startswith(UNSENT)).sum())
        out["slo_attainment"] = int(good.sum()) / sent if sent else float("nan")
    return out


def kv_transfer_metrics(done: pd.DataFrame, percentiles: tuple[float, ...]) -> dict:
    """Disaggregated serving: the KV transfer of each request that moved (start to landing), its bytes, and
    the queueing on each side: for a prefill worker's slot (arrival → first admission) and in the prealloc
    queue (the prefill worker's handoff → transfer start: no decode worker had room)."""
    moved = done[done["kv_transfer_ms"].notna()]
    out = _stats("kv_transfer", moved["kv_transfer_ms"].to_numpy(), percentiles)
    out["mean_kv_transfer_bytes"] = float(moved["kv_transfer_bytes"].mean())
    out.update(_stats("prefill_queue", ((done["admitted_s"] - done["arrival_s"]) * 1e3).dropna().to_numpy(),
                      percentiles))
    out.update(_stats("kv_queue", ((moved["kv_transfer_start_s"] - moved["kv_ready_s"]) * 1e3).to_numpy(),
                      percentiles))
    if "prefill_ttft_ms" in done:  # (a file written before the column existed has none)
        out.update(_stats("prefill_ttft", done["prefill_ttft_ms"].dropna().to_numpy(), percentiles))
    return out


def engine_metrics(iterations: pd.DataFrame, max_batch_size: int) -> dict[str, float]:
    it = iterations
    if it.empty:
        return {"iterations": 0}
    rows = it["num_context_requests"] + it["num_generation_requests"]
    host = ((it["schedule_end_s"] - it["schedule_start_s"]) + (it["prepare_end_s"] - it["prepare_start_s"])
            + (it["postprocess_end_s"] - it["postprocess_start_s"]))
    # the device's step starts with its encode piece where there is one (encoder–decoder models), or the host KV
    # tier's copies (which the step's compute waits for)
    start = it["encode_start_s"].fillna(it["forward_start_s"]) if "encode_start_s" in it else it["forward_start_s"]
    if "kv_host_copy_start_s" in it:
        start = it["kv_host_copy_start_s"].fillna(start)
    busy = (it["sample_end_s"] - start).sum()
    span = it["sample_end_s"].max() - start.min()
    tokens = it["num_tokens"].sum()
    out = {
        "iterations": len(it),
        "mean_batch_size": float(rows.mean()),
        "slot_occupancy": float(it["active_slots"].mean() / max_batch_size),
        "padding_fraction": float(it["num_padding_tokens"].sum() / tokens) if tokens else 0.0,
        "device_busy_fraction": float(busy / span) if span > 0 else float("nan"),
        "host_ms_per_iteration": float(host.mean() * 1e3),
        "device_ms_per_iteration": float((it["sample_end_s"] - start).mean() * 1e3),
        "preemptions": int(it["preemptions"].sum()),
        "kv_evictions": int(it["kv_evictions"].sum()) if "kv_evictions" in it else 0,
    }
    out["overlap_headroom"] = float(host.mean() / (host.mean() + (it["sample_end_s"] - start).mean()))
    out["host_hidden_fraction"] = host_hidden_fraction(it, start)
    workers = it["worker"].nunique() if "worker" in it else 1
    if workers > 1:  # disagg: one device per worker, each busy over its own span
        out["device_busy_fraction"] = float(np.mean([
            ((w["sample_end_s"] - s).sum() / (w["sample_end_s"].max() - s.min()))
            for (_, w), (_, s) in zip(it.groupby("worker"), start.groupby(it["worker"]), strict=True)]))
    bubble = pipeline_bubble_fraction(it)
    if bubble is not None:  # micro-batches overlap on the device: busy is per stage
        out["pipeline_bubble_fraction"] = bubble
        out["device_busy_fraction"] = 1 - bubble
    if "spec_drafts" in it and it["spec_drafts"].sum() > 0:
        out.update(spec_metrics(it))
    if "host_kv_blocks_total" in it and it["host_kv_blocks_total"].any():  # the host KV tier
        out.update(host_tier_metrics(it))
    if "encode_start_s" in it and it["encode_start_s"].notna().any():  # encoder–decoder models
        encode = (it["encode_end_s"] - it["encode_start_s"]).dropna()
        out["encode_ms_per_iteration"] = float(encode.sum() / len(it) * 1e3)
    return out


def host_tier_metrics(it: pd.DataFrame) -> dict:
    """The host KV tier: blocks and bytes copied each way, the seconds of the copy pieces — which every engine here
    waits for before the step's compute, as TensorRT-LLM's does (NaN where the copies were not timed apart: the
    CPU pipeline's stages make them inside their forward) — and the largest worker's peak occupancy."""
    out = {name: int(it[name].sum()) for name in ("kv_offloaded_blocks", "kv_onloaded_blocks", "kv_offloaded_bytes",
                                                   "kv_onloaded_bytes")}
    copy_s = (it["kv_host_copy_end_s"] - it["kv_host_copy_start_s"]).dropna()
    moved = (it["kv_offloaded_blocks"] + it["kv_onloaded_blocks"]).sum() > 0
    out["kv_host_copy_wait_s"] = float(copy_s.sum()) if len(copy_s) or not moved else float("nan")
    out["host_kv_blocks_peak"] = int(it["host_kv_blocks_used"].max())
    return out


def spec_metrics(it: pd.DataFrame) -> dict:
    """Speculative decoding, vLLM's definitions: acceptance rate = accepted / draft tokens; mean acceptance
    length = 1 + accepted / drafts (tokens a verifying step yields); per position j, accepted at j /
    drafts."""
    drafts, proposed, accepted = (int(it[c].sum()) for c in ("spec_drafts", "spec_draft_tokens",
                                                             "spec_accepted_tokens"))
    return {"spec_drafts": drafts, "spec_draft_tokens": proposed, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / proposed, "spec_mean_acceptance_length": 1 + accepted / drafts,
            "spec_acceptance_by_position": [float(x) for x in acceptance_by_position(it)]}


HOST_PHASES = ("schedule", "prepare", "postprocess")


def host_hidden_fraction(iterations: pd.DataFrame, device_start: pd.Series) -> float:
    """Of the host's phase time, the share that ran while the device was busy (any step's device span,
    ``device_start`` → ``sample_end_s``): what overlap hid. 0 for a loop that waits for every step."""
    starts, ends = device_start.to_numpy(float), iterations["sample_end_s"].to_numpy(float)
    keep = ~(np.isnan(starts) | np.isnan(ends))
    order = np.argsort(starts[keep])
    starts, ends = starts[keep][order], np.maximum.accumulate(ends[keep][order]) if keep.any() else ends[:0]
    # The union of the device's spans (pipeline micro-batches overlap) as disjoint intervals [lo, hi)
    first = np.flatnonzero(np.r_[True, starts[1:] > ends[:-1]]) if len(starts) else np.array([], dtype=int)
    lo, hi = starts[first], ends[np.r_[first[1:] - 1, len(starts) - 1]] if len(first) else ends[:0]
    before = np.r_[0.0, np.cumsum(hi - lo)][:-1]  # device-busy seconds before each interval

    def busy_until(t: np.ndarray) -> np.ndarray:
        """Device-busy seconds up to each time in ``t``."""
        i = np.searchsorted(lo, t, side="right") - 1  # the last interval starting at or before t (-1: none)
        j = np.maximum(i, 0)
        return np.where(i >= 0, before[j] + np.clip(t - lo[j], 0.0, hi[j] - lo[j]), 0.0)

    total = hidden = 0.0
    for phase in HOST_PHASES:
        a, b = iterations[f"{phase}_start_s"].to_numpy(float), iterations[f"{phase}_end_s"].to_numpy(float)
        ok = ~(np.isnan(a) | np.isnan(b))
        total += float((b[ok] - a[ok]).sum())
        if len(lo):
            hidden += float((busy_until(b[ok]) - busy_until(a[ok])).sum())
    return hidden / total if total > 0 else float("nan")


def pipeline_bubble_fraction(iterations: pd.DataFrame) -> float | None:
    """Pipeline runs: each stage's idle time over its wall time (its first start to its last end), the
    mean over stages; None for a run without stages."""
    if "stage_start_s" not in iterations:
        return None
    timed = [len(s) > 0 for s in iterations["stage_start_s"]]  # a step never waited for has no times
    starts = [np.asarray(s, dtype=float) for s, t in zip(iterations["stage_start_s"], timed, strict=True) if t]
    ends = [np.asarray(e, dtype=float) for e, t in zip(iterations["stage_end_s"], timed, strict=True) if t]
    if not starts:
        return None
    start, end = np.vstack(starts), np.vstack(ends)  # [iterations, stages]
    busy = (end - start).sum(axis=0)
    wall = end.max(axis=0) - start.min(axis=0)
    return float(np.mean(1 - busy / wall))

