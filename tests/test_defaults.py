"""Defaults a newcomer meets: a sequence length the model supports, long prompts admitted, a run that
rejects requests saying why and what to change, and Hugging Face's bare ``--early-stopping``."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from harness.cli import build_parser
from harness.flags import options_from_args
from harness.traces import synthetic_trace
from tests.util import cli

# The simulated Llama-3-8B: its published config.json has "max_position_embeddings": 8192
SIM_8B = ["--device", "sim", "--model-spec", "llama-3-8b", "--warmup", "0", "--no-progress"]


def _rejected(out, strategy: str) -> pd.DataFrame:
    req = pd.read_parquet(out / strategy / "requests.parquet")
    return req[req["status"] == "rejected"]


def test_max_seq_len_is_the_models_context_capped_by_the_kv_pool(tmp_path):
    p = cli("run", *SIM_8B, "--strategies", "inflight", "--num-prompts", "300", "--input-len", "512",
            "--output-len", "128", "--out", str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "a" / "run.json").read_text())["options"]["max_seq_len"] == 8192
    assert _rejected(tmp_path / "a", "inflight").empty and "note:" not in p.stdout
    # a pool of 100 blocks of 16 tokens holds one request of 1,600 tokens at most
    p = cli("run", *SIM_8B, "--strategies", "inflight", "--num-prompts", "20", "--input-len", "64",
            "--output-len", "16", "--kv-blocks", "100", "--out", str(tmp_path / "b"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "b" / "run.json").read_text())["options"]["max_seq_len"] == 1600
    # the CPU presets: their configs' context lengths
    p = cli("run", "--model", "tiny", "--strategies", "inflight", "--num-prompts", "4", "--input-len", "8",
            "--output-len", "4", "--warmup", "0", "--no-progress", "--out", str(tmp_path / "c"))
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "c" / "run.json").read_text())
    assert meta["options"]["max_seq_len"] == meta["model"]["max_position_embeddings"] == 1024


def test_a_run_that_rejects_says_how_many_why_and_which_option(tmp_path):
    out = tmp_path / "r"
    p = cli("run", *SIM_8B, "--strategies", "static,inflight", "--num-prompts", "300", "--input-len", "512",
            "--output-len", "128", "--max-seq-len", "512", "--out", str(out))
    assert p.returncode == 0, p.stderr
    trace = synthetic_trace(300, 512, 128, range_ratio=0.5, seed=0)  # the run's requests (--range-ratio 0.5)
    too_long = sum(t.input_tokens + t.output_tokens > 512 for t in trace.requests)
    for strategy in ("static", "inflight"):
        req = pd.read_parquet(out / strategy / "requests.parquet")
        rejected = _rejected(out, strategy)
        assert len(rejected) == too_long > 100 and rejected["finish_reason"].str.contains("exceeds max_seq_len").all()
        line = next(x for x in p.stdout.splitlines() if x.startswith(f"note: {strategy} rejected"))
        assert f"rejected {len(rejected)} of {len(req)} requests" in line and "--max-seq-len" in line


def test_long_prompts_are_admitted_by_default(tmp_path):
    """Prompts of 1,500-4,500 tokens against the 1,024-token step budget: chunked prefill (in-flight
    strategies) and a step of its own (static) serve them; without chunking in-flight refuses them and
    says which option would admit them."""
    args = [*SIM_8B, "--num-prompts", "40", "--input-len", "3000", "--output-len", "32", "--range-ratio", "0.5"]
    p = cli("run", *args, "--strategies", "static,inflight,overlap", "--out", str(tmp_path / "on"))
    assert p.returncode == 0, p.stderr
    for strategy in ("static", "inflight", "overlap"):
        req = pd.read_parquet(tmp_path / "on" / strategy / "requests.parquet")
        assert (req["status"] == "finished").all() and req["input_tokens"].max() > 1024, strategy
        it = pd.read_parquet(tmp_path / "on" / strategy / "iterations.parquet")
        if strategy != "static":
            assert it["num_tokens"].max() <= 1024  # the budget held: prompts were split across steps
    p = cli("run", *args, "--strategies", "inflight", "--no-chunked-prefill", "--out", str(tmp_path / "off"))
    assert p.returncode == 0, p.stderr
    assert len(_rejected(tmp_path / "off", "inflight")) == 40
    assert "exceeds max_num_tokens" in p.stdout and "--chunked-prefill" in p.stdout


@pytest.mark.parametrize(("flags", "value"), [([], "false"), (["--early-stopping"], "true"),
                                               (["--early-stopping", "never"], "never"),
                                               (["--early-stopping", "false"], "false"),
                                               (["--early-stopping", "--beam-width", "2"], "true")])
def test_bare_early_stopping_means_true_as_in_hugging_face(flags, value):
    opts = options_from_args(build_parser().parse_args(["run", *flags]))
    assert opts.early_stopping == value
    assert opts.sampling_defaults().early_stopping == {"true": True, "false": False}.get(value, value)


def test_a_row_longer_than_the_budget_gives_the_tokens_chunked_prefill_gives(tmp_path):
    """Static prefills a 60-100-token prompt whole in a step of its own, in-flight in 32-token chunks:
    the same greedy tokens (float64: no near-tie can flip between the two summation orders)."""
    out = tmp_path / "long"
    p = cli("run", "--model", "tiny", "--dtype", "float64", "--strategies", "static,inflight", "--num-prompts", "6",
            "--input-len", "80", "--range-ratio", "0.25", "--output-len", "8", "--output-range-ratio", "0",
            "--ignore-eos", "--max-num-tokens", "32", "--max-batch-size", "4", "--warmup", "0", "--no-progress",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    tokens = {s: [json.loads(x)["tokens"] for x in (out / s / "tokens.jsonl").read_text().splitlines()]
              for s in ("static", "inflight")}
    assert tokens["static"] == tokens["inflight"] and all(len(t) == 8 for t in tokens["static"])
    static = pd.read_parquet(out / "static" / "iterations.parquet")
    assert static["num_tokens"].max() > 32  # a whole row over the budget ran in one step
    assert pd.read_parquet(out / "inflight" / "iterations.parquet")["num_tokens"].max() <= 32
