"""Beam search against Hugging Face ``generate``, for every strategy, and the KV it holds.

The reference is transformers' own beam search on a random float64 Llama checkpoint: the returned
sequences and their order must be equal, the scores equal to float32 rounding (slotbench's float64 forward
over paged KV sums in another order than HF's, so a float32 logit can differ in its last bit).
"""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.runtime.kv.block_manager import BlockManager
from strategies.runtime.models.checkpoint import config_from_hf, load_checkpoint
from strategies.runtime.models.llama import script_model
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from tests.util import assert_accounted, make_requests, run_strategy

pytestmark = pytest.mark.xdist_group("beams")  # one worker: its module fixture is built once

NEW = 10
# (prompt length, beam width, returned, length penalty, early stopping, stop ids besides EOS)
CASES = [
    (5, 2, 2, 1.0, False, ()),
    (9, 4, 3, 1.0, False, (283,)),  # 283 ends some beams after two tokens
    (14, 4, 4, 0.5, True, ()),  # EOS ends one beam at the first step
    (7, 2, 1, 1.2, "never", ()),
    (20, 1, 1, 1.0, False, ()),  # greedy requests in the same batches
    (14, 2, 2, 2.0, "never", (158,)),  # the 14-token prompt again: a prefix hit for a beam request
    (11, 1, 1, 1.0, False, ()),
    (6, 4, 2, 0.8, False, (133, 60)),
]


@pytest.fixture(scope="module")
def setup(hf_checkpoint):
    path, hf = hf_checkpoint
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    model = script_model(load_checkpoint(path, cfg))
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(3, 300, size=n).tolist() for n in sorted({c[0] for c in CASES})}
    specs, refs = [], []
    for n, k, ret, lp, es, stops in CASES:
        specs.append((prompts[n], NEW, SamplingParams(beam_width=k, num_return_sequences=ret, length_penalty=lp,
                                                      early_stopping=es, stop_token_ids=stops)))
        refs.append(_hf(hf, prompts[n], k, ret, lp, es, stops))
    return cfg, model, specs, refs


def _hf(hf, prompt: list[int], k: int, ret: int, lp: float, es, stops: tuple[int, ...]):
    """HF's returned sequences (generated part, cut at each one's own length) and scores."""
    ids = torch.tensor([prompt])
    if k == 1:
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=[2, *stops])
        seq = out[0, len(prompt):].tolist()
        for i, t in enumerate(seq):  # greedy pads a finished sequence: cut after its stop
            if t in (2, *stops):
                return [(seq[:i + 1], None)]
        return [(seq, None)]
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, num_beams=k,
                      num_return_sequences=ret, length_penalty=lp, early_stopping=es, pad_token_id=0,
                      eos_token_id=[2, *stops], return_dict_in_generate=True, output_scores=True)
    lengths = (out.beam_indices >= 0).sum(dim=1)  # each sequence's own generated length
    return [(out.sequences[j, len(prompt):len(prompt) + int(lengths[j])].tolist(), float(out.sequences_scores[j]))
            for j in range(ret)]


def _check(requests: list[Request], refs) -> None:
    assert_accounted(requests)
    for r, ref in zip(requests, refs, strict=True):
        if r.width == 1:
            assert r.beams is None and r.output_token_ids == ref[0][0], r.request_id
            continue
        assert [t for t, _ in r.beams] == [t for t, _ in ref], r.request_id
        assert [s for _, s in r.beams] == pytest.approx([s for _, s in ref], rel=1e-6, abs=1e-6), r.request_id
        assert r.output_token_ids == ref[0][0]


def test_the_cases_exercise_early_finishes(setup):
    """The reference itself: some returned beams end at a stop id before the length limit, so the
    comparisons below cover hypotheses that finish early, not only length-limited ones."""
    _, _, specs, refs = setup
    early = [len(t) for (_, _, s), ref in zip(specs, refs, strict=True) if s.beam_width > 1 for t, _ in ref
             if len(t) < NEW]
    assert len(early) >= 2


BASE = dict(max_batch_size=16, max_seq_len=64, tokens_per_block=4, max_beam_width=4)
CONFIGS = {
    "plain": ExecutorConfig(**BASE),
    "split-memory": ExecutorConfig(**BASE, device_memory="split"),
    "chunked-prefix-cache": ExecutorConfig(**BASE, max_num_tokens=8, chunked_prefill=True, prefix_caching=True),
    "preemption": ExecutorConfig(**BASE, capacity_policy="max-utilization", kv_blocks=24),
}


# static batching neither chunks prompts nor preempts
PAIRS = [(s, c) for c in CONFIGS for s in ("static", "inflight", "overlap")
         if s != "static" or c in ("plain", "split-memory")]


@pytest.mark.parametrize(("strategy", "config"), PAIRS)
def test_beams_equal_transformers_generate(setup, strategy, config):
    cfg, model, specs, refs = setup
    requests = make_requests(specs)
    s = run_strategy(strategy, cfg, model, CONFIGS[config], requests)
    _check(requests, refs)
    if config == "preemption":  # the configuration is meant to force recomputation of a beam request
        assert any(r.preemptions and r.width > 1 for r in requests)
    if config == "chunked-prefix-cache":
        assert any(r.cached_tokens and r.width > 1 for r in requests)
    beam_rows = sum(r.num_beam_rows for r in s.records)
    # every decoding step of a beam request is K rows (overlap and static also compute discarded ones)
    assert beam_rows >= sum(r.width * (r.num_output_tokens - 1) for r in requests if r.width > 1)


def test_beam_blocks_are_shared_prompt_plus_own_per_beam():
    """A 3-beam request with a 10-token prompt in 4-token blocks: the two full prompt blocks are held
    once; from block 2 (positions 8..11, the prompt's tail and the first generated tokens) each beam holds
    its own. Grown to 18 tokens: 5 blocks for beam 0, 3 more for each other beam."""
    kv = BlockManager(num_blocks=20, tokens_per_block=4, num_slots=2, max_blocks_per_seq=8, max_beam=3)
    r = Request("b", np.arange(10), 8, SamplingParams(beam_width=3))
    kv.admit(0, [], 10, width=3, prompt_len=10)
    assert kv.blocks_in_use == 3 + 2 * 1
    kv.grow(0, 18)
    assert kv.blocks_in_use == 5 + 2 * 3
    t = kv.tables[0]
    assert (t[1, :2] == t[0, :2]).all() and (t[2, :2] == t[0, :2]).all()  # every beam lists the prompt's blocks
    own = [set(t[b, 2:5].tolist()) for b in range(3)]
    assert not (own[0] & own[1]) and not (own[1] & own[2]) and not (own[0] & own[2])
    kv.release(0, r)
    assert kv.free_blocks == 20


def test_beam_request_limits_are_checked():
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingParams(beam_width=2, temperature=0.5)
    with pytest.raises(ValueError, match="num_return_sequences"):
        SamplingParams(beam_width=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(beam_width=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="beam width"):
        ExecutorConfig(max_batch_size=4, max_beam_width=8)


def test_simulated_device_charges_a_row_per_beam():
    """4 requests of 4 beams cost the simulated device what 16 greedy requests at the same positions
    cost, step for step once decoding (the cost model sees rows, whoever owns them)."""
    from harness.runner import build_requests
    from harness.runner import run_strategy as run
    from harness.traces.trace import TraceRequest
    from strategies.config import SimConfig
    from strategies.runtime.sim.engine import proxy_config
    from strategies.runtime.sim.specs import MODEL_SPECS

    def decode_steps(n: int, width: int):
        cfg = ExecutorConfig(device="sim", sim=SimConfig(gpu="h200", model_spec="llama-3-8b"), max_batch_size=16,
                             max_seq_len=512, max_num_tokens=8192, max_beam_width=width)
        mcfg = proxy_config(MODEL_SPECS["llama-3-8b"])
        reqs = build_requests([TraceRequest(0.0, 256, 32)] * n, SamplingParams(ignore_eos=True, beam_width=width),
                              mcfg.vocab_size, 0)
        result = run("inflight", mcfg, None, cfg, reqs)
        assert result.error is None and all(r.status.value == "finished" for r in reqs)
        return [(r.num_tokens, r.num_beam_rows, r.sample_end_s - r.forward_start_s) for r in result.records
                if r.num_context_requests == 0]

    beams, greedy = decode_steps(4, 4), decode_steps(16, 1)
    assert len(beams) == len(greedy) == 31
    assert all(tokens == 16 and rows == 16 for tokens, rows, _ in beams)
    assert all(rows == 0 for _, rows, _ in greedy)
    assert [t for *_, t in beams] == pytest.approx([t for *_, t in greedy], rel=1e-9)


def slotbench(*args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))


TINY = ["--model", "tiny", "--max-batch-size", "16", "--max-seq-len", "64", "--warmup", "1", "--no-progress"]


def test_cli_beams_from_flags_and_trace_lines(tmp_path):
    """--beam-width/--num-return-sequences as defaults, a trace line's beam_width overriding them;
    tokens.jsonl carries the best sequence and the returned beams, best first, the same sequences from
    every strategy (scores may differ in float32's last bits: batch shapes change the logits' rounding)."""
    trace = tmp_path / "t.jsonl"
    lines = [{"arrival_s": 0.0, "input_tokens": 12, "output_tokens": 8},
             {"arrival_s": 0.0, "input_tokens": 20, "output_tokens": 6, "beam_width": 1},
             {"arrival_s": 0.01, "input_tokens": 9, "output_tokens": 8, "beam_width": 2, "length_penalty": 0.0},
             {"arrival_s": 0.02, "input_tokens": 30, "output_tokens": 8, "early_stopping": "never"}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    p = slotbench("run", *TINY, "--trace", str(trace), "--beam-width", "4", "--num-return-sequences", "2",
                  "--strategies", "static,inflight,overlap", "--out", str(out))
    assert p.returncode == 0, p.stderr
    runs = {}
    for s in ("static", "inflight", "overlap"):
        rows = [json.loads(x) for x in (out / s / "tokens.jsonl").read_text().splitlines()]
        runs[s] = [(x["tokens"], [b["tokens"] for b in x.get("beams", [])]) for x in rows]
        beams = [x.get("beams") for x in rows]
        assert [len(b) if b else 0 for b in beams] == [2, 0, 2, 2]
        for x in rows:
            if x.get("beams"):
                assert x["tokens"] == x["beams"][0]["tokens"]
                assert x["beams"][0]["score"] >= x["beams"][1]["score"]
        it = pd.read_parquet(out / s / "iterations.parquet")
        assert it["num_beam_rows"].max() >= 4
    assert runs["static"] == runs["inflight"] == runs["overlap"]


@pytest.mark.parametrize(("args", "message"), [
    (["--beam-width", "2", "--num-return-sequences", "3"], "num_return_sequences must be in [1, beam_width=2]"),
    (["--beam-width", "2", "--temperature", "0.5"], "temperature must be 0 with beam_width > 1"),
    (["--beam-width", "32"], "beam width must be in [1, --max-batch-size=16]"),
    (["--beam-width", "2", "--early-stopping", "maybe"], "invalid choice"),
])
def test_cli_bad_beam_options_are_one_line_exit_2(tmp_path, args, message):
    p = slotbench("run", *TINY, "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--out",
                  str(tmp_path / "x"), *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_trace_line_with_bad_beam_fields_names_file_and_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 2, "beam_width": 2}\n'
                     '{"arrival_s": 1, "input_tokens": 5, "output_tokens": 2, "early_stopping": "maybe"}\n')
    p = slotbench("run", *TINY, "--trace", str(trace), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and f"{trace}:2: early_stopping: 'maybe'" in p.stderr, p.stderr
