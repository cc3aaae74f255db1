"""Speculation against request rate on a simulated deployment: Llama-3-70B, TP4 on H200s, 1,000 requests
of 1,024 → 256 tokens, n-gram with K = 4 and a forced acceptance of 0.6 (mean acceptance length ~2.1), at
rising Poisson rates. At low load decoding reads every weight once per step and speculation divides TPOT
by about the mean length; as the batch grows the linear layers turn compute-bound and the verify tokens
are paid for in full. ``python -m pytest -m speed -s tests/benchmarks/test_spec_sim_rates.py`` prints the
table (a minute or two)."""

from __future__ import annotations

import json

import pytest

from harness.app import execute
from harness.options import RunOptions

RATES = (1.0, 4.0, 8.0, 16.0, 64.0)
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "acceptance_rate": 0.6})


@pytest.mark.speed
def test_speculation_against_request_rate_70b(tmp_path, benchmark):
    benchmark(lambda: None)  # whole runs, below
    rows = []
    for rate in RATES:
        base = {"device": "sim", "gpu": "h200", "model_spec": "llama-3-70b", "tp": 4, "request_rate": rate,
                "num_prompts": 1000, "input_len": 1024, "output_len": 256, "ignore_eos": True,
                "max_batch_size": 256, "max_num_tokens": 8192, "strategies": ("inflight",)}
        out = {}
        for name, spec in (("plain", None), ("spec", SPEC)):
            s = execute(RunOptions(**base, speculative_config=spec), tmp_path / f"{name}{rate}", progress=False,
                        report=False).summary.iloc[0]
            out[name] = s
        rows.append((rate, out["plain"], out["spec"]))
    print("\nrate req/s  batch  tok/s plain → spec  median TPOT ms plain → spec  p99 TTFT ms plain → spec")
    for rate, p, s in rows:
        print(f"{rate:10.0f}  {p['mean_batch_size']:5.0f}  {p['output_throughput']:7,.0f} → "
              f"{s['output_throughput']:7,.0f}  {p['median_tpot_ms']:8.2f} → {s['median_tpot_ms']:6.2f}  "
              f"{p['p99_ttft_ms']:9,.0f} → {s['p99_ttft_ms']:7,.0f}")
    low = rows[0]
    assert low[2]["median_tpot_ms"] < low[1]["median_tpot_ms"] / 1.5  # low load: TPOT divided by ~the mean length
