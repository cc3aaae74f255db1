"""Speculative decoding (n-gram drafts): the tokens never change, only how many steps they take.

The references are outside slotbench's speculation: Hugging Face's prompt-lookup candidate generator
for the drafts, ``generate(prompt_lookup_num_tokens=K)`` and a one-request full recomputation for the
tokens; the counters are checked against what the requests received, step by step."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from harness.source import TraceSource
from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.models.checkpoint import config_from_hf, load_checkpoint
from strategies.runtime.models.llama import script_model
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams
from strategies.runtime.spec.config import SpecConfig
from strategies.runtime.spec.ngram import propose_ngram
from tests.util import (
    TINY64,
    ListSource,
    assert_accounted,
    cli,
    make_requests,
    reference_decode,
    run_strategy,
    tiny_models,
)

SPEC = SpecConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def test_ngram_drafts_are_hugging_faces_prompt_lookup():
    """Hugging Face's PromptLookupCandidateGenerator (n-gram sizes max..1, first match) proposes what
    propose_ngram does, on 400 random sequences over a small alphabet (so that n-grams repeat)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = np.random.default_rng(1)
    proposed = 0
    for _ in range(400):
        tokens = rng.integers(3, 9, size=int(rng.integers(2, 30)))
        k, max_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hf = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([2]), num_output_tokens=k,
                                            max_matching_ngram_size=max_n, max_length=10_000)
        ids = torch.tensor([tokens.tolist()])
        candidates, _ = hf.get_candidates(ids)
        expected = candidates[0, len(tokens):].tolist()
        got = propose_ngram(tokens, 1, max_n, k).tolist()
        assert got == expected, (tokens.tolist(), k, max_n)
        proposed += bool(got)
    assert proposed > 200  # the comparison is not between two empty lists


def test_ngram_takes_the_longest_suffix_then_its_earliest_occurrence():
    t = np.array([1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3])
    assert propose_ngram(t, 1, 3, 2).tolist() == [4, 1]  # [2, 3] first at 1 (the 3-gram [9, 2, 3] never)
    assert propose_ngram(t, 3, 3, 2).tolist() == []  # no earlier 3-gram
    assert propose_ngram(np.array([7, 8, 7]), 1, 2, 5).tolist() == [8, 7]  # may run into the suffix itself


def _specs(n: int, seed: int = 0, sampled: bool = False) -> list[tuple[list[int], int, SamplingParams]]:
    """Prompts that repeat a pattern (n-gram lookup finds drafts), greedy or seeded sampling."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pattern = rng.integers(3, 512, size=int(rng.integers(2, 6))).tolist()
        prompt = pattern * int(rng.integers(2, 5)) + rng.integers(3, 512, size=int(rng.integers(0, 4))).tolist()
        s = SamplingParams(temperature=0.8, top_k=20, seed=i) if sampled and i % 2 else SamplingParams()
        out.append((prompt, int(rng.integers(4, 40)), s))
    return out


def _spec_totals(strategy) -> tuple[int, int]:
    return (sum(r.spec_draft_tokens for r in strategy.records), sum(r.spec_accepted_tokens for r in strategy.records))


VARIANTS = [
    {},
    {"chunked_prefill": False},
    {"capacity_policy": "max-utilization", "kv_blocks": 24},  # preempts
    {"prefix_caching": True},
    {"device_memory": "split"},
    {"cpu_device": "thread", "device_memory": "split"},
]


@pytest.mark.parametrize("extra", VARIANTS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "default")
@pytest.mark.parametrize("name", ["inflight", "static", "overlap"])
def test_speculation_changes_no_token(name, extra):
    """Greedy and seeded sampling: every request's tokens equal a one-request full recomputation (and so
    a run without speculation), while drafts were proposed and some accepted."""
    eager, scripted = tiny_models()
    specs = _specs(12, seed=3, sampled=True)
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=96, tokens_per_block=4, max_num_tokens=32, speculative=SPEC,
                         **extra)
    reqs = make_requests(specs)
    s = run_strategy(name, TINY64, scripted, cfg, reqs, keep_open=True)
    try:
        assert_accounted(reqs)
        for r, exp in zip(reqs, expected, strict=True):
            assert r.status is Status.FINISHED and r.output_token_ids == exp, (extra, r.request_id)
        proposed, accepted = _spec_totals(s)
        assert proposed > 0 and 0 < accepted < proposed
        if extra.get("capacity_policy") == "max-utilization" and name == "inflight":
            assert sum(r.preemptions for r in reqs) > 0
        kv = s.kv  # every block back: free, or cached and reusable
        assert kv.free_blocks == kv.total_blocks and kv.blocks_in_use == 0
    finally:
        s.close()


def test_rejected_positions_blocks_go_back_at_once_under_max_utilization():
    """Under max-utilization a verifying request grows to hold its drafts' positions; once its outputs are
    read it holds no block past the one its next token needs (checked as every iteration starts)."""
    _, scripted = tiny_models()
    reqs = make_requests(_specs(8, seed=11))
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=96, tokens_per_block=2, capacity_policy="max-utilization",
                         speculative=SPEC)
    strategy = get_strategy("inflight")(TINY64, scripted, cfg)
    excess: list[int] = []

    def check(_: int) -> None:
        for r in strategy.running:
            if not r.is_prefilling:
                excess.append(strategy.kv.held(r.slot) - strategy.kv.blocks_for(r.num_computed_tokens + 1))

    strategy.iteration_hook = check
    try:
        strategy.run(ListSource(reqs))
    finally:
        strategy.close()
    assert _spec_totals(strategy)[0] > _spec_totals(strategy)[1] > 0 and excess and max(excess) <= 0


def test_stops_and_length_limits_inside_a_verified_run():
    """A stop id, or max_new_tokens, reached among tokens received in one verifying step: the request ends
    exactly there, as the reference does, never a token past it. Tokens received in one step share
    their time, which shows the end fell inside such a run."""
    eager, scripted = tiny_models()
    base = _specs(16, seed=5)
    refs = [reference_decode(eager, TINY64, r) for r in make_requests([(p, 40, s) for p, _, s in base])]
    specs = []
    for i, ((prompt, _, s), ref) in enumerate(zip(base, refs, strict=True)):
        cut = 2 + i % max(1, len(ref) - 2)
        if i % 2:  # a stop id: the token the reference produces at ``cut`` (and never earlier)
            tok = ref[min(cut, len(ref) - 1)]
            specs.append((prompt, 40, replace(s, stop_token_ids=(tok,))))
        else:
            specs.append((prompt, min(cut + 1, 40), s))
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    reqs = make_requests(specs)
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=96, tokens_per_block=4, speculative=SPEC)
    run_strategy("inflight", TINY64, scripted, cfg, reqs)
    ended_inside = 0
    for r, exp in zip(reqs, expected, strict=True):
        assert r.output_token_ids == exp and r.num_output_tokens <= r.max_new_tokens, r.request_id
        ended_inside += len(r.token_times_s) > 1 and r.token_times_s[-1] == r.token_times_s[-2]
    assert ended_inside >= 3


def test_rejected_positions_never_reach_the_prefix_cache():
    """Two-turn sessions with prefix caching: turn 1 reads turn 0's history, prompt and outputs, from the
    cache — blocks whose keys were written by verifying steps, rejected drafts included, then rewound
    and rewritten. Turn 1's tokens equal a full recomputation of its whole prompt, so no cached key was
    a rejected draft's."""
    eager, scripted = tiny_models()
    reqs = []
    for i, (prompt, n, s) in enumerate(_specs(6, seed=7)):
        reqs.append(Request(f"s{i}t0", np.array(prompt), 30, s, session_id=f"s{i}", turn=0))
        reqs.append(Request(f"s{i}t1", np.array(prompt[:3]), n, s, session_id=f"s{i}", turn=1))
    cfg = ExecutorConfig(max_batch_size=3, max_seq_len=160, tokens_per_block=4, prefix_caching=True, kv_blocks=120,
                         speculative=SPEC)
    strategy = get_strategy("inflight")(TINY64, scripted, cfg)
    try:
        strategy.run(TraceSource(reqs))
    finally:
        strategy.close()
    assert _spec_totals(strategy)[1] > 0
    for r in reqs:
        assert r.status is Status.FINISHED
        alone = Request("ref", r.prompt_token_ids.copy(), r.max_new_tokens, r.sampling)
        assert r.output_token_ids == reference_decode(eager, TINY64, alone), r.request_id
        if r.turn:
            assert r.cached_tokens >= 12, r.request_id


def test_prompt_lookup_equals_hugging_face(hf_checkpoint):
    """A checkpoint run with n-gram speculation gives Hugging Face's generate(prompt_lookup_num_tokens=K)."""
    path, hf_model = hf_checkpoint
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    model = script_model(load_checkpoint(path, cfg))
    rng = np.random.default_rng(2)
    prompts = [(rng.integers(3, 300, size=3).tolist() * 4)[: int(n)] for n in (7, 12, 9, 11)]
    reqs = make_requests([(p, 20, SamplingParams()) for p in prompts])
    spec = SpecConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    run_strategy("inflight", cfg, model, ExecutorConfig(max_batch_size=4, max_seq_len=64, speculative=spec), reqs)
    for p, r in zip(prompts, reqs, strict=True):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                pad_token_id=0, prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
        assert r.output_token_ids == ref[0, len(p):].tolist()


def test_counters_follow_vllms_definitions(tmp_path):
    """summary.csv's acceptance metrics recomputed from iterations.parquet with vLLM's formulas, and the
    accepted tokens accounted for: a request receives, per step, one token plus the drafts it accepted."""
    import pandas as pd

    out = tmp_path / "r"
    p = cli("run", "--model", "tiny", "--strategies", "inflight", "--num-prompts", "6", "--input-len", "24",
            "--output-len", "48", "--ignore-eos", "--warmup", "0", "--no-progress", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}', "--out", str(out))
    assert p.returncode == 0, p.stderr
    it = pd.read_parquet(out / "inflight" / "iterations.parquet")
    row = json.loads((out / "summary.json").read_text())[0]
    drafts, proposed, accepted = (int(it[c].sum()) for c in ("spec_drafts", "spec_draft_tokens",
                                                             "spec_accepted_tokens"))
    assert row["spec_draft_tokens"] == proposed and row["spec_accepted_tokens"] == accepted > 0
    assert row["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert row["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    by_pos = np.array(row["spec_acceptance_by_position"])
    assert len(by_pos) == 4 and (np.diff(by_pos) <= 0).all() and by_pos.sum() * drafts == pytest.approx(accepted)
    tokens = [json.loads(x) for x in (out / "inflight" / "tokens.jsonl").read_text().splitlines()]
    steps = sum(len(set(t["times_s"])) for t in tokens)  # each step hands a request its tokens at one time
    assert sum(len(t["tokens"]) for t in tokens) == steps + accepted


@pytest.mark.parametrize(("args", "message"), [
    (["--speculative-config", "{bad"], "--speculative-config is not JSON"),
    (["--speculative-config", '{"method": "eagle"}'], "method 'eagle'"),
    (["--speculative-config", '{"method": "ngram", "k": 3}'], "unknown key(s) k"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "must be in [1, 16]"),
    (["--speculative-config", '{"method": "ngram"}', "--strategies", "pipeline"], "pipeline does not speculate"),
    (["--speculative-config", '{"method": "ngram"}', "--beam-width", "2"], "beam search does not speculate"),
    (["--speculative-config", '{"method": "ngram"}', "--device", "sim"], "so it needs acceptance_rate"),
    (["--speculative-config", '{"method": "ngram", "acceptance_rate": 0.5}'], "only the simulated device forces"),
    (["--speculative-config", '{"method": "ngram", "acceptance_rate": 1.5}', "--device", "sim"], "must be in [0, 1]"),
    (["--speculative-config", '{"method": "ngram", "acceptance_rate": "hi"}'], "must be a number"),
    (["--speculative-config", '{"method": "draft_model", "model": "tiny-bart"}'], "with the target's vocabulary"),
    (["--speculative-config", '{"method": "draft_model", "model": "/nonexistent"}'], "--speculative-config model:"),
    (["--speculative-config", '{"method": "draft_model", "acceptance_rate": 0.5}', "--device", "sim"],
     "method draft_model needs a model"),
    (["--speculative-config", '{"method": "ngram", "model": "tiny"}'], "and only it takes one"),
    (["--speculative-config", '{"method": "draft_model", "model": 3}'], "model must be a string"),
])
def test_bad_speculative_config_is_one_line_exit_2(tmp_path, args, message):
    base = ["--model", "tiny", "--num-prompts", "2", "--strategies", "inflight"]
    p = cli("run", *base, *args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def _chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's test at alpha = 0.001 (critical value by Wilson-Hilferty: no scipy here)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(probs) - 1
    return stat < df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_acceptance_is_rejection_sampling():
    """20,000 seeded rows verify drafts (3, 5) against fixed target distributions p0, p1, p2 at temperature
    1: the first token received is distributed as p0 whether or not the draft was kept (the definition of
    speculative sampling), draft 3 is kept with probability p0(3), a rejected draft is followed by the
    residual p0 without 3, and the second token (given the first draft kept) is distributed as p1."""
    from strategies.runtime.decoder.accept import accept_drafts

    rows, vocab = 20_000, 8
    probs = torch.softmax(torch.tensor([[0.5, 1.0, 0.2, 1.5, 0.0, 0.8, -0.5, 0.3],
                                        [0.1, 0.4, 1.2, 0.0, 0.3, 1.6, 0.2, -0.2],
                                        [0.0] * vocab], dtype=torch.float64), dim=1)  # [3, V]
    logits = probs.log().float().repeat(rows, 1)  # [R * 3, V]: each row's positions 0, 1, 2
    slots = torch.arange(rows)
    drafts = torch.tensor([[3, 5]]).repeat(rows, 1)
    out = torch.zeros(rows, 6, dtype=torch.long)
    per_slot = {"temperature": torch.ones(rows), "top_k": torch.zeros(rows, dtype=torch.long),
                "top_p": torch.ones(rows), "min_p": torch.zeros(rows), "seed": slots * 7919 + 1}
    accept_drafts(logits, slots, drafts, torch.full((rows,), 2), out, per_slot["temperature"], per_slot["top_k"],
                  per_slot["top_p"], per_slot["min_p"], per_slot["seed"], torch.zeros(rows, 1, dtype=torch.long),
                  torch.zeros(rows, dtype=torch.long), torch.full((rows,), 100), torch.full((rows, 1), -1),
                  torch.zeros(rows, dtype=torch.bool), False, True)
    first, second, kept = out[:, 0].numpy(), out[:, 1].numpy(), out[:, 5].numpy()
    p0, p1 = probs[0].numpy(), probs[1].numpy()
    assert _chi_square_ok(np.bincount(first, minlength=vocab), p0)
    assert abs((kept >= 1).mean() - p0[3]) < 3.3 * (p0[3] * (1 - p0[3]) / rows) ** 0.5
    rejected = first[kept == 0]
    residual = np.delete(p0, 3) / (1 - p0[3])
    assert (rejected != 3).all() and _chi_square_ok(np.delete(np.bincount(rejected, minlength=vocab), 3), residual)
    assert _chi_square_ok(np.bincount(second[kept >= 1], minlength=vocab), p1)


def test_an_empty_speculative_config_is_off():
    """A suite's sweep cannot write None in TOML: "" beside a JSON object compares runs without and with."""
    from harness.options import RunOptions

    assert RunOptions(speculative_config="").speculative() is None
    assert RunOptions(speculative_config='{"method": "ngram"}').speculative() == SpecConfig()


DRAFT = SpecConfig(method="draft_model", model="tiny", num_speculative_tokens=4)


def _draft_specs(n: int = 8, greedy: bool = False) -> list:
    rng = np.random.default_rng(0)
    return [(rng.integers(3, 60, size=int(rng.integers(5, 30))).tolist(), 24,
             SamplingParams(temperature=0.0 if greedy or i % 2 == 0 else 0.8, seed=i)) for i in range(n)]


@pytest.mark.parametrize("name,kw", [
    ("static", {}),
    ("inflight", {"cpu_device": "thread"}),
    ("inflight", {}),  # the draft's engine in a device process of its own
    ("inflight", {"device_memory": "split"}),
    ("inflight", {"capacity_policy": "max-utilization", "kv_blocks": 8}),  # preempted requests start their draft over
    ("inflight", {"prefix_caching": True}),
    ("overlap", {}),  # the draft's passes run while the target's previous step does
    ("overlap", {"device_memory": "split"}),
    ("overlap", {"capacity_policy": "max-utilization", "kv_blocks": 8}),
], ids=["static", "thread", "process", "split", "preempt", "prefix", "overlap", "overlap-split", "overlap-preempt"])
def test_a_draft_model_that_is_the_target_is_always_right(name, kw):
    """With the target itself as the draft (tiny, same seed: the same weights) every greedy draft is the
    target's own next token — under overlap the draft's guess of a pending token too: all are accepted, and
    the tokens are each request's alone."""
    eager, model = tiny_models()
    specs = _draft_specs(greedy=True)
    if kw.get("prefix_caching"):
        specs = [([7] * 16 + p[:16], n, s) for p, n, s in specs]
    reqs = make_requests(specs)
    s = run_strategy(name, TINY64, model, ExecutorConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=32,
                                                         speculative=DRAFT, **kw), reqs)
    drafted = sum(r.spec_draft_tokens for r in s.records)
    assert drafted > 100 and sum(r.spec_accepted_tokens for r in s.records) == drafted
    assert all(r.output_token_ids == reference_decode(eager, TINY64, r) for r in reqs)
    if kw.get("kv_blocks"):
        assert sum(r.preemptions for r in s.records) > 0


@pytest.mark.parametrize("name", ["inflight", "overlap"])
def test_draft_model_proposals_are_the_drafts_greedy_continuation(monkeypatch, name):
    """Every proposal, step after step, equals the draft model's greedy continuation of what the request
    holds (recomputed from scratch): the draft's keys are rewound to what the target accepted, so a
    rejection (sampled requests reject often) leaves no stale key behind. Under overlap a row whose last
    token is still on the device continues one token further: the first is its guess, the rest the drafts
    (and a wrong guess's key is not kept). Tokens equal each request alone."""
    from strategies.runtime.spec.draft_model import DraftModel

    eager, model = tiny_models()
    checked, guessed = [], []
    propose = DraftModel.propose

    def spy(self, steps, tables):
        propose(self, steps, tables)
        for v in steps:
            r = v.request
            held = r.token_ids[:v.position + 1].copy()  # under overlap it may end before the chunk's first
            pending = len(held) == v.position
            guessed.append(pending)
            alone = Request("x", held, len(v.drafts) + pending, SamplingParams(ignore_eos=True))
            checked.append(v.drafts.tolist() == reference_decode(eager, TINY64, alone)[pending:])

    monkeypatch.setattr(DraftModel, "propose", spy)
    reqs = make_requests(_draft_specs())
    s = run_strategy(name, TINY64, model, ExecutorConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=32,
                                                         speculative=DRAFT, cpu_device="thread"), reqs)
    rejected = sum(r.spec_draft_tokens - r.spec_accepted_tokens for r in s.records)
    assert len(checked) > 30 and all(checked) and rejected > 50
    assert any(guessed) == (name == "overlap")
    assert all(r.output_token_ids == reference_decode(eager, TINY64, r) for r in reqs)


@pytest.mark.parametrize(("name", "memory"), [("static", "shared"), ("inflight", "shared"), ("inflight", "split"),
                                           ("overlap", "shared"), ("overlap", "split")])
def test_draft_model_equals_hugging_faces_assisted_generation(hf_checkpoint, tmp_path, name, memory):
    """A checkpoint verified against a one-layer assistant of its vocabulary gives Hugging Face's
    ``generate(assistant_model=...)`` (greedy), and the assistant is sometimes right, sometimes not."""
    import transformers

    path, hf_model = hf_checkpoint
    small = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                     eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(1)
    assistant = transformers.LlamaForCausalLM(small).to(torch.float64).eval()
    assistant.save_pretrained(tmp_path / "draft", safe_serialization=True)
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    model = script_model(load_checkpoint(path, cfg))
    rng = np.random.default_rng(2)
    prompts = [(rng.integers(3, 300, size=4).tolist() * 3)[: int(n)] for n in (7, 12, 9, 11)]
    reqs = make_requests([(p, 20, SamplingParams()) for p in prompts])
    spec = SpecConfig(method="draft_model", model=str(tmp_path / "draft"), num_speculative_tokens=3)
    s = run_strategy(name, cfg, model, ExecutorConfig(max_batch_size=4, max_seq_len=64, speculative=spec,
                                                      device_memory=memory), reqs)
    for p, r in zip(prompts, reqs, strict=True):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                pad_token_id=0, assistant_model=assistant)
        assert r.output_token_ids == ref[0, len(p):].tolist()
    drafted, accepted = (sum(getattr(x, f) for x in s.records) for f in ("spec_draft_tokens", "spec_accepted_tokens"))
    assert 0 < accepted < drafted


@pytest.mark.parametrize("spec", [SpecConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1),
                                  DRAFT], ids=["ngram", "draft-model"])
def test_static_rows_that_finish_early_stay_in_their_blocks(spec):
    """Static batching computes a finished row as padding until its batch ends. A row that reached its
    max_new_tokens early by accepting drafts used to step past its reservation and write, through a
    block-table entry it did not hold (block 0), into another request's KV: greedy rows then diverged from
    their reference (seeds 2 and 3 here did). Every token equals each request alone."""
    eager, model = tiny_models()
    for seed in (2, 3):
        rng = np.random.default_rng(seed)
        reqs = make_requests([(rng.integers(3, 60, size=int(rng.integers(5, 30))).tolist(), 24,
                               SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i)) for i in range(8)])
        run_strategy("static", TINY64, model, ExecutorConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=32,
                                                             speculative=spec, cpu_device="thread"), reqs)
        assert all(r.output_token_ids == reference_decode(eager, TINY64, r) for r in reqs), seed


def test_a_discarded_verify_chunk_is_all_padding():
    """A verify chunk is the request's last token and its k drafts: 1 + k tokens computed. When nothing of it
    reaches the request (it finished meanwhile, or the device discarded the row), all 1 + k are padding."""
    from strategies.runtime.batch import VerifyStep
    from strategies.runtime.buffers.draft_tokens import DraftTokens
    from strategies.runtime.buffers.sim_memory import SimMemory
    from strategies.runtime.decoder.finish import CONTINUE, DISCARDED
    from strategies.runtime.iteration import IterationRecord
    from strategies.speculation import receive_verified

    finished, discarded = (Request(f"r{i}", np.arange(1, 6), 8, SamplingParams()) for i in range(2))
    finished.status, discarded.status = Status.FINISHED, Status.RUNNING
    for slot, r in enumerate((finished, discarded)):
        r.slot = slot
    d = DraftTokens(4, 4, SimMemory())
    d.fill([VerifyStep(finished, 5, np.array([7, 8, 9])), VerifyStep(discarded, 5, np.array([7, 8]))],
           np.zeros((4, 2), bool))
    outputs = [[0] * 5 + [0, CONTINUE, 0], [0] * 5 + [0, DISCARDED, 0]]  # K + 1 tokens, received, code, drafts
    rec = IterationRecord(0)
    assert receive_verified(rec, d, outputs, 1.0, None) == []
    assert rec.num_padding_tokens == (1 + 3) + (1 + 2) and rec.spec_drafts == 0
