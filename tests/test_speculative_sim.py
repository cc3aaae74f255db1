"""Speculative decoding on the simulated device: a forced acceptance rate, verification priced.

Checked against what does not come from the implementation: a request's tokens do not depend on
speculation (the simulated device's token rule is per request and step, so a run without speculation is
the reference); forced acceptance is geometric (draft j is kept with probability a^(j+1)); and the roofline:
a batch-1 decode step of an 8B model reads every weight once, so verifying 1 + K tokens costs about what
decoding one does and speculation pays almost its mean acceptance length, while at batch 256 the linear
layers are compute-bound, the verify step costs several decode steps, and the same acceptance does not pay
(vLLM's measured 1.5-2.8x at low load turning into slowdowns at high load)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest

from harness.app import execute
from harness.options import RunOptions
from reports.load import load_runs
from reports.speculation import speculation


def _spec(rate: float, k: int = 4) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "acceptance_rate": rate})


def _run(tmp_path, name: str, **kw) -> tuple[dict, pd.DataFrame, dict[str, list[int]]]:
    opts = RunOptions(device="sim", gpu="h100", model_spec="llama-3-8b", **kw)
    out = tmp_path / name
    summary = execute(opts, out, progress=False, report=False).summary.iloc[0].to_dict()
    strategy = opts.strategies[0]
    it = pd.read_parquet(out / strategy / "iterations.parquet")
    tokens = {}
    for line in (out / strategy / "tokens.jsonl").read_text().splitlines():
        t = json.loads(line)
        tokens[t["request_id"]] = t["tokens"]
    return summary, it, tokens


@pytest.mark.parametrize("strategy", ["inflight", "static", "overlap"])
def test_forced_acceptance_is_geometric_and_changes_no_token(tmp_path, strategy):
    kw = {"strategies": (strategy,), "num_prompts": 120, "request_rate": 20.0, "input_len": 64, "output_len": 96,
          "max_batch_size": 16}  # EOS where the token rule draws it: stops inside verified runs too
    _, base_it, base_tokens = _run(tmp_path, "plain", **kw)
    spec, spec_it, spec_tokens = _run(tmp_path, "spec", speculative_config=_spec(0.6), **kw)
    assert spec_tokens == base_tokens  # same tokens, stops and lengths
    assert spec["spec_drafts"] > 1000 and len(spec_it) < len(base_it)
    by_position = spec["spec_acceptance_by_position"]
    for j, p in enumerate(by_position):
        assert p == pytest.approx(0.6 ** (j + 1), abs=0.04), by_position
    # every verifying row is a generating row of its iteration (the batch size counts it)
    assert (spec_it["num_generation_requests"] >= spec_it["spec_drafts"]).all()
    # the report's figure: the same geometric curve, and TPOT of both runs labelled with and without
    fig = speculation(load_runs([tmp_path / "plain", tmp_path / "spec"]))
    curve, bars = fig.data[0], fig.data[1]
    assert list(curve.x) == [1, 2, 3, 4] and curve.y == pytest.approx([0.6 ** j for j in (1, 2, 3, 4)], abs=0.04)
    assert list(bars.x) == [f"plain / {strategy} (without)", f"spec / {strategy} (speculative)"]
    assert bars.y[1] < bars.y[0]  # fewer steps per token: a lower median TPOT


def test_verification_pays_where_decoding_is_memory_bound_only(tmp_path):
    speedup = {}
    for batch in (1, 256):
        kw = {"strategies": ("inflight",), "num_prompts": max(8, 2 * batch), "input_len": 512, "output_len": 128,
              "ignore_eos": True, "max_batch_size": batch, "max_num_tokens": 8192}
        plain, *_ = _run(tmp_path, f"plain{batch}", **kw)
        spec, *_ = _run(tmp_path, f"spec{batch}", speculative_config=_spec(0.5), **kw)
        speedup[batch] = spec["output_throughput"] / plain["output_throughput"]
        length = spec["spec_mean_acceptance_length"]  # 1 + .5 + .25 + .125 + .0625 = 1.94 at K = 4
        assert length == pytest.approx(1.94, abs=0.1)
        if batch == 1:  # tokens per step up by the mean length, step time up a little (KV reads, LM head)
            assert 0.8 * length < speedup[batch] <= length
    assert speedup[256] < 1, speedup


def test_a_draft_model_costs_what_speculative_decoding_theory_says(tmp_path):
    """Llama-3-8B verifying drafts of Llama-3.2-1B on an H100, one request at a time, a = 0.7, K = 4.
    Leviathan et al.: a step yields E = (1 - a^(K+1)) / (1 - a) tokens and costs one verifying forward plus
    K draft decodes, so TPOT = (T_verify + K T_draft) / E, with T_verify and T_draft the prices of one
    batch-1 step of each model (plus the stream's launch and sync latency per step). Tokens equal the run
    without speculation: only time moves. The draft's weights and KV come off the target's KV capacity
    (8.03 B and 1.24 B bf16 parameters; 128 KiB and 32 KiB of KV a token, from the two config.json files)."""
    from strategies.runtime.batch import BatchWork
    from strategies.runtime.sim.build import cost_model
    from strategies.runtime.sim.config import SimConfig

    # host time modelled at 0: the formula prices the device's steps only (measured host time, serial with
    # them under inflight, is this machine's: ~0.5 ms of a ~15 ms verifying cycle)
    kw = {"strategies": ("inflight",), "num_prompts": 6, "request_rate": 0.2, "input_len": 512, "output_len": 128,
          "range_ratio": 0.0, "ignore_eos": True, "host_time": "modelled"}
    draft = json.dumps({"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 4,
                        "acceptance_rate": 0.7})
    plain, _, plain_tokens = _run(tmp_path, "plain", **kw)
    spec, _, spec_tokens = _run(tmp_path, "draft", speculative_config=draft, **kw)
    ngram, *_ = _run(tmp_path, "ngram", speculative_config=_spec(0.7), **kw)
    assert spec_tokens == plain_tokens
    a, k, ctx = 0.7, 4, 512 + 64  # the context at mid-request
    target, small = (cost_model(SimConfig(gpu="h100", model_spec=m)) for m in ("llama-3-8b", "llama-3.2-1b"))
    t_verify = sum(target.phases(BatchWork(k + 1, k + 1, (k + 1) * ctx, (k + 1) * ctx)).values())
    t_draft = sum(small.phases(BatchWork(1, 1, ctx, ctx)).values())
    step = t_verify + k * t_draft + target.profile.launch_latency_s + target.profile.sync_latency_s
    predicted_ms = step / ((1 - a ** (k + 1)) / (1 - a)) * 1e3
    assert spec["median_tpot_ms"] == pytest.approx(predicted_ms, rel=0.12)
    assert ngram["median_tpot_ms"] < spec["median_tpot_ms"] < plain["median_tpot_ms"]
    run = json.loads((tmp_path / "draft" / "run.json").read_text())["sim"]
    expected = (0.9 * 80e9 - 2 * 8.03e9 - 2 * 1.24e9) / (2 * 32 * 8 * 128 * 2 + 2 * 16 * 8 * 64 * 2)
    assert run["kv_capacity_tokens"] == pytest.approx(expected, rel=0.01)


def test_itl_counts_streamed_chunks_not_tokens(tmp_path):
    """A verifying step hands its accepted tokens out together: one streamed chunk, so one ITL gap, as `vllm
    bench serve` counts it. Every gap is then at least the shortest device step (no zero gaps pull the median
    toward 0 at acceptance 0.6, K = 4), and each request's `itls` in vllm_bench.json has one entry per distinct
    token time after its first, read from tokens.jsonl."""
    kw = {"strategies": ("inflight",), "num_prompts": 60, "request_rate": 20.0, "input_len": 64, "output_len": 96,
          "max_batch_size": 16, "ignore_eos": True}
    summary, it, _ = _run(tmp_path, "spec", speculative_config=_spec(0.6), **kw)
    shortest_step_ms = float((it["sample_end_s"] - it["forward_start_s"]).min()) * 1e3
    assert summary["median_itl_ms"] >= shortest_step_ms
    bench = json.loads((tmp_path / "spec" / "inflight" / "vllm_bench.json").read_text())
    times = {json.loads(x)["request_id"]: json.loads(x)["times_s"]
             for x in (tmp_path / "spec" / "inflight" / "tokens.jsonl").read_text().splitlines()}
    ids = pd.read_parquet(tmp_path / "spec" / "inflight" / "requests.parquet")["request_id"]
    shared = 0
    for rid, itls in zip(ids, bench["itls"], strict=True):
        distinct = sorted(set(times[rid]))
        shared += len(times[rid]) - len(distinct)
        assert itls == pytest.approx([b - a for a, b in itertools.pairwise(distinct)])
    assert shared > 500  # accepted drafts did share their step's time


def test_a_draft_models_first_pass_takes_in_the_prompt(tmp_path):
    """At its first verification a request's draft model has seen none of it: pass 1 feeds its whole prompt
    (spec/draft_model.py), so that step costs a draft prefill of the prompt more than a later one, whose pass
    1 feeds one or two tokens. One request at a time: each first verifying step (right after the prefill)
    exceeds the median verifying step by the draft's 513-token chunk less its one-token pass."""
    from strategies.runtime.batch import BatchWork
    from strategies.runtime.sim.build import cost_model
    from strategies.runtime.sim.config import SimConfig

    kw = {"strategies": ("inflight",), "num_prompts": 4, "max_concurrency": 1, "input_len": 512, "output_len": 64,
          "range_ratio": 0.0, "ignore_eos": True, "host_time": "modelled"}  # strictly one request at a time
    draft = json.dumps({"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 4,
                        "acceptance_rate": 0.7})
    _, it, _ = _run(tmp_path, "draft", speculative_config=draft, **kw)
    device = (it["sample_end_s"] - it["forward_start_s"]).to_numpy()
    verifying = (it["spec_drafts"] > 0).to_numpy()
    first = verifying & np.concatenate([[False], it["num_context_tokens"].to_numpy()[:-1] > 0])
    assert first.sum() == 4
    small = cost_model(SimConfig(gpu="h100", model_spec="llama-3.2-1b"))
    n = 512 + 1  # the prompt and the token the target sampled from it
    prefill = sum(small.phases(BatchWork(n, 1, n, n * (n + 1) // 2, n, n, n * (n + 1) // 2, 1)).values())
    one = sum(small.phases(BatchWork(1, 1, n, n, 1, n, n, 1)).values())
    extra = device[first] - np.median(device[verifying & ~first])
    assert extra == pytest.approx(np.full(4, prefill - one), rel=0.25)
