"""``slotbench trace-info``: what a trace looks like before you replay it."""

from __future__ import annotations

import numpy as np

from harness.traces.prompts import ideal_prefix_hit_rate
from harness.traces.trace import Trace


def trace_info(trace: Trace, tokens_per_block: int = 16) -> dict:
    arr, inp, out = trace.arrays()
    duration = float(arr[-1] - arr[0]) if len(arr) > 1 else 0.0
    gaps = np.diff(arr)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else float("nan")
    pct = (50, 90, 99)
    info = {
        "source": trace.source, "format": trace.format, "rows": len(trace), "skipped_failed_rows": trace.skipped,
        "duration_s": round(duration, 3), "rate_req_s": round(len(arr) / duration, 3) if duration > 0 else None,
        "interarrival_cv": round(cv, 3),  # burstiness: 1 for Poisson, > 1 burstier
    }
    for name, x in (("input", inp), ("output", out)):
        info[f"{name}_mean"] = round(float(x.mean()), 1)
        for p in pct:
            info[f"{name}_p{p}"] = float(np.percentile(x, p))
    # What an infinite prefix cache of tokens_per_block blocks serves, in arrival order (prefix_cache_hit_rate
    # of a run whose cache never evicts and whose requests never overlap).
    info["tokens_per_block"] = tokens_per_block
    info["ideal_prefix_hit_rate"] = round(ideal_prefix_hit_rate(trace.requests, tokens_per_block), 6)
    info["notes"] = list(trace.notes)
    return info
