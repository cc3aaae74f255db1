"""NVIDIA AIPerf (PyPI) against ``slotbench serve``, the way a user points it at ``vllm serve DIR``: ``-m DIR``, the
same directory as the server's ``--model``, streamed completions. AIPerf pins pandas below 3, so it lives in a
virtual environment of its own (``.venv-aiperf`` at the repository's root, made once, on first use)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.test_serve import Server
from tests.util import char_tokenizer

AIPERF = "aiperf==0.13.0"
VENV = Path(__file__).resolve().parents[1] / ".venv-aiperf"


@pytest.fixture(scope="module")
def aiperf() -> Path:
    exe = VENV / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        p = subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", AIPERF], capture_output=True, text=True,
                           timeout=1200)
        if p.returncode != 0:
            pytest.skip(f"{AIPERF} could not be installed from PyPI: {p.stderr.strip().splitlines()[-1:]}")
    return exe


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random Llama checkpoint (seeded) and a tokenizer of one character per id whose post-processor adds BOS,
    saved together, as a model directory a user serves."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("model")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-()\n"
    char_tokenizer(chars, "<unk>", unk_token="<unk>").save_pretrained(d)
    return d


def test_aiperf_with_the_models_path_as_its_name_against_the_servers_records(aiperf, model_dir, tmp_path):
    """20 streamed completions, 4 at a time, 32 prompt tokens and 16 out: every one succeeds under the name AIPerf
    takes from ``-m``; the server counts them with AIPerf's prompt length (its tokenizer adds BOS once, as vLLM's),
    AIPerf reads the server's usage, and its TTFT and each HTTP exchange's time sit at or above the server's own."""
    server = Server(tmp_path, "--model", str(model_dir), "--strategy", "inflight", "--max-batch-size", "8")
    art = tmp_path / "aiperf"
    try:
        p = subprocess.run([str(aiperf), "profile", "-m", str(model_dir), "--url", server.url, "--endpoint-type",
                            "completions", "--streaming", "--tokenizer", str(model_dir), "--request-count", "20",
                            "--concurrency", "4", "--synthetic-input-tokens-mean", "32",
                            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", "16",
                            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--artifact-dir",
                            str(art), "--ui-type", "none"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    finally:
        code, err = server.stop()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert code == 0, err
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 20 and not summary["error_summary"]
    records = [json.loads(line)["metrics"] for line in (art / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 20
    assert all(r["usage_completion_tokens"]["value"] == 16 for r in records)
    assert all(r["usage_prompt_tokens"]["value"] == 32 for r in records)
    served = pd.read_parquet(server.out / "inflight" / "requests.parquet")
    served = served[served["request_id"].str.startswith("cmpl-")]
    assert len(served) == 20 and (served["status"] == "finished").all() and (served["output_tokens"] == 16).all()
    assert (served["input_tokens"] == 32).all()
    # AIPerf's TTFT and latency end at a response with text: this random model's tokens are often ones that decode
    # to none (special, unknown), so its latency may end before the server's last token; the whole HTTP exchange
    # (http_req_duration) holds every token
    aiperf_ttft = pd.Series([r["time_to_first_token"]["value"] for r in records])
    http = pd.Series([r["http_req_duration"]["value"] for r in records])
    assert aiperf_ttft.min() >= served["ttft_ms"].min() and aiperf_ttft.median() >= served["ttft_ms"].median()
    assert http.min() >= served["e2el_ms"].min() and http.median() >= served["e2el_ms"].median()
