"""Encoder–decoder models (BART): greedy tokens against Hugging Face ``generate``, for every strategy,
and the encoder buffers / cross-attention KV they run on."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.models.checkpoint import config_from_hf, load_checkpoint
from strategies.runtime.models.llama import script_model
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, ListSource, assert_accounted, run_strategy, tiny_models

pytestmark = pytest.mark.xdist_group("encoder-decoder")  # one worker: its module fixture is built once

transformers = pytest.importorskip("transformers")
NEW = 12
# (encoder length, decoder prompt length after the start token, stop ids besides EOS)
CASES = [(7, 0, ()), (20, 3, ()), (5, 1, (199,)), (33, 0, ()), (12, 6, ()), (9, 2, (41,)), (26, 24, ()), (3, 0, ())]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """A random BartForConditionalGeneration in float64 saved with save_pretrained (init_std 0.2: the
    default 0.02 makes a random model repeat one token), EOS made likely enough to end some requests."""
    cfg = transformers.BartConfig(vocab_size=300, d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128, max_position_embeddings=128, forced_eos_token_id=None,
                                  init_std=0.2)
    torch.manual_seed(0)
    hf = transformers.BartForConditionalGeneration(cfg).to(torch.float64).eval()
    with torch.no_grad():
        hf.final_logits_bias[0, 2] = 3.0
    path = tmp_path_factory.mktemp("bart")
    hf.save_pretrained(path, safe_serialization=True)
    mc = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    model = script_model(load_checkpoint(path, mc))
    rng = np.random.default_rng(0)
    specs, refs = [], []
    for enc_len, dec_len, stops in CASES:
        enc = rng.integers(3, 300, size=enc_len).tolist()
        dec = [2, *rng.integers(3, 300, size=dec_len).tolist()]  # BART's decoder starts with its start token
        ids = torch.tensor([enc])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), decoder_input_ids=torch.tensor([dec]),
                          max_new_tokens=NEW, do_sample=False, eos_token_id=[2, *stops])[0, len(dec):].tolist()
        for i, t in enumerate(out):  # HF pads a finished sequence: cut after its stop
            if t in (2, *stops):
                out = out[:i + 1]
                break
        specs.append((enc, dec, stops))
        refs.append(out)
    return mc, model, specs, refs, path


def _requests(specs) -> list[Request]:
    return [Request(f"r{i}", np.array(dec), NEW, SamplingParams(stop_token_ids=stops),
                    encoder_prompt_token_ids=np.array(enc)) for i, (enc, dec, stops) in enumerate(specs)]


def test_the_cases_stop_early_and_run_long(bart):
    """The reference itself: some requests end at EOS or a stop id before the length limit, some reach
    it, and outputs are not all one repeated token."""
    refs = bart[3]
    assert any(len(r) < NEW and r[-1] == 2 for r in refs) and any(len(r) == NEW for r in refs)
    assert sum(len(set(r)) > 2 for r in refs) >= 2


BASE = dict(max_batch_size=4, max_seq_len=64, max_num_tokens=64, tokens_per_block=4)
CONFIGS = {
    "plain": ExecutorConfig(**BASE),
    "split-memory": ExecutorConfig(**BASE, device_memory="split"),
    # the 24-token decoder prompt is chunked after its 26 encoder tokens; the cache forces preemption
    "chunked-preemption": ExecutorConfig(**{**BASE, "max_num_tokens": 40}, chunked_prefill=True,
                                         capacity_policy="max-utilization", kv_blocks=12),
}
PAIRS = [(s, c) for c in CONFIGS for s in ("static", "inflight", "overlap")
         if s != "static" or c != "chunked-preemption"]  # static batching neither chunks nor preempts


@pytest.mark.parametrize(("strategy", "config"), PAIRS)
def test_greedy_tokens_equal_transformers_generate(bart, strategy, config):
    mc, model, specs, refs, _ = bart
    requests = _requests(specs)
    s = run_strategy(strategy, mc, model, CONFIGS[config], requests, keep_open=True)
    try:
        assert_accounted(requests)
        assert [r.output_token_ids for r in requests] == refs
        assert s.cross_kv.free_blocks == s.cross_kv.total_blocks  # every request let its cross KV go
        limit = CONFIGS[config].max_num_tokens
        assert all(r.num_tokens + r.num_encoder_tokens <= max(limit, 4) for r in s.records)
        assert sum(r.num_encoder_tokens for r in s.records) >= sum(len(e) for e, _, _ in specs)
        if config == "chunked-preemption":
            assert any(r.preemptions for r in requests)
    finally:
        s.close()


def test_encode_runs_first_on_the_device_and_counts_in_ttft(bart):
    """Each request's first token comes after the encode piece of the step that admitted it (its own
    encoder output, not any request's), and an encode piece runs before its step's forward."""
    mc, model, specs, _, _ = bart
    requests = _requests(specs)
    s = get_strategy("overlap")(mc, model, ExecutorConfig(**BASE))
    admitted_in: dict[str, int] = {}  # request → the iteration that admitted it (first admission)
    schedule = s.scheduler.schedule

    def spy(iteration, running):
        batch = schedule(iteration, running)
        for r in batch.admitted:
            admitted_in.setdefault(r.request_id, iteration)
        return batch

    s.scheduler.schedule = spy
    try:
        s.run(ListSource(requests))
    finally:
        s.close()
    recs = {r.iteration: r for r in s.records}
    encoding = [r for r in s.records if r.num_encoder_tokens]
    assert encoding and all(r.encode_start_s <= r.encode_end_s <= r.forward_start_s for r in encoding)
    assert all(np.isnan(r.encode_start_s) for r in s.records if not r.num_encoder_tokens)
    assert len(admitted_in) == len(requests)
    for r in requests:  # a token needs its own encoder's output
        assert r.first_token_s > recs[admitted_in[r.request_id]].encode_end_s, r.request_id
    assert len(set(admitted_in.values())) > 1  # admissions spread over steps: the check is per request


def test_cross_kv_capacity_limits_concurrency(bart):
    """16-token encoder inputs take 4 cross blocks of 4 tokens each; with 8 cross blocks at most two
    requests run at once, whatever the slots and the self-attention cache allow."""
    mc, model, _, _, _ = bart
    encoder = np.random.default_rng(1).integers(3, 300, size=(6, 16))
    for strategy in ("static", "inflight"):
        requests = [Request(f"c{i}", np.array([2]), 6, SamplingParams(ignore_eos=True),
                            encoder_prompt_token_ids=encoder[i]) for i in range(6)]
        s = run_strategy(strategy, mc, model, ExecutorConfig(**BASE, cross_kv_blocks=8), requests)
        assert_accounted(requests)
        assert max(r.active_slots for r in s.records) == 2, strategy


def test_bad_pairings_are_rejected(bart):
    mc, model, specs, _, _ = bart
    enc, dec, _ = specs[0]
    only_decoder = Request("d", np.array(dec), 4, SamplingParams())
    beams = Request("b", np.array(dec), 4, SamplingParams(beam_width=2), encoder_prompt_token_ids=np.array(enc))
    run_strategy("inflight", mc, model, ExecutorConfig(**BASE, max_beam_width=2), [only_decoder, beams])
    assert only_decoder.finish_reason == "an encoder–decoder model needs encoder input"
    assert beams.finish_reason == "beam search with an encoder–decoder model is not supported"
    with_encoder = Request("e", np.array([5, 6, 7]), 4, SamplingParams(), encoder_prompt_token_ids=np.array(enc))
    run_strategy("inflight", TINY64, tiny_models()[1], ExecutorConfig(**BASE), [with_encoder])
    assert with_encoder.finish_reason == "encoder input given to a decoder-only model"


def slotbench(*args):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))


def test_cli_runs_an_encoder_decoder_checkpoint(bart, tmp_path):
    *_, path = bart
    trace = tmp_path / "t.jsonl"
    lines = [{"arrival_s": 0.0, "prompt_token_ids": [2], "output_tokens": 8, "encoder_prompt_token_ids": [5, 9, 77]},
             {"arrival_s": 0.01, "input_tokens": 4, "output_tokens": 8, "encoder_input_tokens": 30}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    p = slotbench("run", "--model", str(path), "--dtype", "float64", "--trace", str(trace), "--max-seq-len", "64",
                  "--warmup", "1", "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    summary = pd.read_csv(out / "summary.csv")
    assert (summary["completed"] == 2).all() and (summary["encode_ms_per_iteration"] > 0).all()
    timeline = json.loads((out / "inflight" / "timeline.json").read_text())
    assert any(e["name"] == "encode" and e["tid"] == 2 for e in timeline["traceEvents"] if e["ph"] == "X")
    it = pd.read_parquet(out / "inflight" / "iterations.parquet")
    assert it["num_encoder_tokens"].sum() >= 33


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "tiny", "--encoder-input-len", "8"], "is decoder-only, but 4 requests have an encoder input"),
    (["--model", "tiny-bart"], "is an encoder–decoder model: 4 requests have no encoder input"),
    (["--model", "tiny-bart", "--encoder-input-len", "8", "--prefix-caching"], "--prefix-caching: an encoder"),
])
def test_cli_mismatched_model_and_inputs_are_one_line_exit_2(tmp_path, args, message):
    p = slotbench("run", "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--warmup", "0",
                  "--no-progress", "--out", str(tmp_path / "x"), *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_synthetic_encoder_inputs_on_the_preset(tmp_path):
    out = tmp_path / "run"
    p = slotbench("run", "--model", "tiny-bart", "--num-prompts", "12", "--input-len", "4", "--output-len", "6",
                  "--encoder-input-len", "24", "--range-ratio", "0.5", "--max-seq-len", "64", "--warmup", "1",
                  "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr
    req = pd.read_parquet(out / "overlap" / "requests.parquet")
    assert (req["status"] == "finished").all()
    tokens = {s: (out / s / "tokens.jsonl").read_text() for s in ("static", "inflight", "overlap")}
    assert tokens["static"].count("\n") == 12


def test_simulated_device_charges_the_encoder_and_cross_attention():
    """bart-large on a simulated H100: the encode piece is at least its GEMMs' FLOPs at the datasheet peak
    (2 x tokens x (4h² + 2hi) per encoder layer, from the published shapes), grows with the encoder input,
    and longer encoder inputs make decode steps read more cross KV."""
    from harness.runner import build_requests
    from harness.runner import run_strategy as run
    from harness.traces.trace import TraceRequest
    from strategies.config import SimConfig
    from strategies.runtime.sim.engine import proxy_config
    from strategies.runtime.sim.specs import GPUS, MODEL_SPECS

    spec = MODEL_SPECS["bart-large"]
    h, i = spec.hidden_size, spec.intermediate_size

    def records(encoder_len: int):
        cfg = ExecutorConfig(device="sim", sim=SimConfig(gpu="h100", model_spec="bart-large"), max_batch_size=8,
                             max_seq_len=1024, max_num_tokens=8192)
        mcfg = proxy_config(spec)
        reqs = build_requests([TraceRequest(0.0, 4, 32, encoder_tokens=encoder_len)] * 8,
                              SamplingParams(ignore_eos=True), mcfg.vocab_size, 0)
        result = run("inflight", mcfg, None, cfg, reqs)
        assert result.error is None and all(r.num_output_tokens == 32 for r in reqs)
        return result.records

    short, long = records(64), records(768)
    for recs in (short, long):
        encoding = [r for r in recs if r.num_encoder_tokens]
        assert sum(r.num_encoder_tokens for r in encoding) == 8 * (64 if recs is short else 768)
        for r in encoding:
            floor = 2 * r.num_encoder_tokens * (4 * h * h + 2 * h * i) * spec.encoder_layers / GPUS["h100"].peak_flops
            assert floor <= r.encode_end_s - r.encode_start_s
    encode = [sum(r.encode_end_s - r.encode_start_s for r in recs if r.num_encoder_tokens) for recs in (short, long)]
    assert encode[1] > 4 * encode[0]

    def decode_ms(recs):
        return np.mean([r.sample_end_s - r.forward_start_s for r in recs if not r.num_context_requests]) * 1e3
    assert decode_ms(long) > decode_ms(short)
