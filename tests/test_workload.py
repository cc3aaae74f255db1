"""Workload configs (inference-perf's, the measured runs' JSON) as requests, and real token ids on sim."""

import json

import numpy as np
import pandas as pd
import pytest

from harness.errors import UserError
from harness.traces.workload import load_workload
from harness.traces.workload_trace import workload_trace
from tests.util import cli

SHARED_PREFIX = """\
load:
  type: constant
  stages:
  - rate: 4
    duration: 10
  - rate: 10
    duration: 5
api:
  type: completion
  streaming: true
server:
  type: vllm
  ignore_eos: true
data:
  type: shared_prefix
  shared_prefix:
    num_unique_system_prompts: 3
    num_users_per_system_prompt: 4
    system_prompt_len: 40
    question_len: 20
    output_len: 7
"""


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_shared_prefix_as_inference_perf_builds_it(tmp_path):
    path = _write(tmp_path, "w.yaml", SHARED_PREFIX)
    t = workload_trace(load_workload(path), path, seed=0, vocab_size=1000)
    reqs = t.requests
    assert len(reqs) == 4 * 10 + 10 * 5  # rate x duration per stage
    stage = np.array([r.stage for r in reqs])
    arrivals = np.array([r.arrival_s for r in reqs])
    assert (stage[:40] == 0).all() and (stage[40:] == 1).all()
    # the constant timer's gaps are scaled to the stage: its last request is sent at the stage's end
    assert arrivals[39] == pytest.approx(10.0) and arrivals[-1] == pytest.approx(15.0)
    assert (np.diff(arrivals) > 0).all() and arrivals[0] > 0
    assert t.stages == ((0.0, 10.0, 4.0), (10.0, 15.0, 10.0))
    prompts = [r.prompt_token_ids for r in reqs]
    assert all(len(p) == 1 + 40 + 20 and p[0] == 1 for p in prompts)  # BOS, system prompt, question
    assert len(set(prompts)) == 12  # 3 groups x 4 prompts
    # request i of a stage sends prompt i mod N, counted from 0 in each stage as inference-perf's generator counts
    # (``get_request(request_number)``, range(num_requests) a stage): stage 1's first request sends prompt 0
    assert all(prompts[i] == prompts[i % 12] for i in range(40))
    assert all(prompts[40 + j] == prompts[j % 12] for j in range(50)) and prompts[40] != prompts[40 % 12]
    prefixes = {p[:41] for p in prompts}
    assert len(prefixes) == 3  # one system prompt per group, shared by its 4 prompts
    assert all(sum(q[:41] == p for q in prompts[:12]) == 4 for p in prefixes)
    assert {r.output_tokens for r in reqs} == {7} and all(r.input_tokens == 61 for r in reqs)
    again = workload_trace(load_workload(path), path, seed=0, vocab_size=1000)
    assert again.requests == t.requests  # seeded


def _byte_fallback_tokenizer(directory) -> str:
    """A Llama-shaped tokenizer.json (BPE with byte fallback, "▁" for spaces, BOS added; Llama 2's normaliser and
    decoder): 256 byte pieces, "▁", 300 CJK characters, and merges of "▁" with each of them. Random ids do not survive
    decode and encode with it: a lone byte piece of 0x80-0xFF decodes to U+FFFD, which encodes back as three byte
    pieces, and a space merges with the character after it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    chars = [chr(0x4E00 + i) for i in range(300)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259,
             **{c: 260 + i for i, c in enumerate(chars)}, **{"▁" + c: 560 + i for i, c in enumerate(chars)}}
    merges = [("▁", c) for c in chars]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return str(directory)


def test_a_tokenizer_gives_the_prompts_the_server_tokenised(tmp_path):
    """inference-perf's generator (Feb 2026, shared_prefix_datagen.py) sends each prompt as text: its group's random
    system ids decoded, a space, its random question ids decoded; the server tokenises that text. Given the server's
    tokenizer the replay's prompts are that text's ids: each decodes to its group's system text, a space and a
    question, and they are longer than the ids drawn (the lone bytes' U+FFFD re-encodes as three)."""
    from harness.serve.tokenizer import CheckpointTokenizer

    path = _write(tmp_path, "w.yaml", SHARED_PREFIX)
    tok = CheckpointTokenizer(_byte_fallback_tokenizer(tmp_path / "tok"))
    t = workload_trace(load_workload(path), path, seed=0, vocab_size=1000, tokenizer=tok)
    prompts = [r.prompt_token_ids for r in t.requests[:12]]
    assert len(set(prompts)) == 12 and all(p[0] == 1 for p in prompts)  # BOS, as the server adds it
    texts = [tok.decode(list(p)) for p in prompts]
    assert all(tok.encode(text) == list(p) for text, p in zip(texts, prompts, strict=True))  # the server's ids
    starts = [text[:15] for text in texts]  # (40 system ids decode to more characters than that)
    assert sorted(starts.count(s) for s in set(starts)) == [4, 4, 4]  # a group's 4 prompts open with its system text
    for start in set(starts):  # and then a space: what the group's prompts share ends there
        group = [text for text in texts if text.startswith(start)]
        shared = next(i for i, chars in enumerate(zip(*group, strict=False)) if len(set(chars)) > 1)
        assert group[0][shared - 1] == " ", group
    lens = np.array([len(p) for p in prompts])
    assert lens.mean() > 1.3 * (1 + 40 + 20)  # 23% of the draws are bytes 0x80-0xFF: U+FFFD, three ids each
    assert all(r.input_tokens == len(r.prompt_token_ids) for r in t.requests)
    run = cli("run", "--device", "sim", "--model-spec", "llama-3-8b", "--gpu", "h100", "--workload-config", path,
              "--tokenizer", str(tmp_path / "tok"), "--strategies", "inflight", "--out", str(tmp_path / "out"),
              "--no-progress")
    assert run.returncode == 0, run.stderr
    served = pd.read_parquet(tmp_path / "out" / "inflight" / "requests.parquet")
    assert served["input_tokens"].mean() == pytest.approx(np.mean([r.input_tokens for r in t.requests]))
    small = cli("run", "--device", "sim", "--model-spec", "tiny", "--workload-config", path, "--tokenizer",
                str(tmp_path / "tok"), "--out", str(tmp_path / "small"), "--no-progress")  # a vocabulary of 512
    assert small.returncode == 2 and "past the model's vocabulary (512)" in small.stderr
    assert "Traceback" not in small.stderr and not (tmp_path / "small").exists()


def test_a_tokenizer_gives_random_data_as_the_server_tokenised_it(tmp_path):
    """inference-perf's random generator (Feb 2026, random_datagen.py) sends each prompt as its drawn ids decoded,
    special tokens kept; with the server's tokenizer each replayed prompt is that text's ids, longer than the ids
    drawn (the lone bytes' U+FFFD), one prompt a request."""
    from harness.serve.tokenizer import CheckpointTokenizer

    text = SHARED_PREFIX.split("data:")[0] + """\
data:
  type: random
  input_distribution: {min: 20, max: 40, mean: 30, std_dev: 5}
  output_distribution: {min: 5, max: 9, mean: 7, std_dev: 0}
"""
    path = _write(tmp_path, "r.yaml", text)
    tok = CheckpointTokenizer(_byte_fallback_tokenizer(tmp_path / "tok"))
    drawn = workload_trace(load_workload(path), path, seed=0, vocab_size=1000)
    t = workload_trace(load_workload(path), path, seed=0, vocab_size=1000, tokenizer=tok)
    assert len(t.requests) == len(drawn.requests) == 90
    prompts = [r.prompt_token_ids for r in t.requests]
    assert len(set(prompts)) == 90 and all(r.input_tokens == len(r.prompt_token_ids) for r in t.requests)
    assert all(p[0] == 1 for p in prompts)  # the server's BOS
    assert any(i in (0, 2) for p in prompts for i in p[1:])  # drawn special tokens stay in the text, and come back
    assert np.mean([len(p) for p in prompts]) > 1.3 * np.mean([r.input_tokens for r in drawn.requests])


def test_poisson_and_random_data(tmp_path):
    text = SHARED_PREFIX.replace("type: constant", "type: poisson").split("data:")[0] + """\
data:
  type: random
  input_distribution: {min: 10, max: 50, mean: 30, std_dev: 10}
  output_distribution: {min: 5, max: 9, mean: 7, std_dev: 0}
"""
    text = text.replace("rate: 10\n    duration: 5", "rate: 200\n    duration: 50")
    path = _write(tmp_path, "r.yaml", text)
    t = workload_trace(load_workload(path), path, seed=3, vocab_size=1000)
    # inference-perf's PoissonLoadTimer: a Poisson count of requests in each second, spread over it as its constant
    # timer spreads a stage (the second's last request at its end), and its multi-process loop sends rate x duration
    # of them: exactly 10,000 here (exponential gaps cut at the stage's end gave a Poisson total)
    stage1 = np.array([r.arrival_s for r in t.requests if r.stage == 1])
    assert len(stage1) == 200 * 50
    ends = np.isclose(stage1 - 10.0, np.round(stage1 - 10.0), rtol=0, atol=1e-9)  # a second's last request
    assert 45 <= ends.sum() <= 50 and np.isclose(stage1[ends] - 10.0, np.arange(1, ends.sum() + 1)).all()
    per_second = np.bincount(np.ceil(stage1 - 10.0 - 1e-9).astype(int))[1:]
    assert abs(per_second[:-1].mean() - 200) < 10 and 100 < per_second[:-1].var() < 300  # Poisson: var = mean
    inp = np.array([r.input_tokens for r in t.requests])
    assert inp.min() >= 10 and inp.max() <= 50 and abs(inp.mean() - 30) < 1
    assert {r.output_tokens for r in t.requests} == {7}
    assert all(r.prompt_token_ids is None for r in t.requests)  # random ids, built by the run


def test_measured_json_sizes_prompts_to_the_server_count(validation):
    path = str(validation / "20260217-231439-llama-2-7b-tp1-general.json")
    doc = json.loads((validation / "20260217-231439-llama-2-7b-tp1-general.json").read_text())
    t = workload_trace(load_workload(path), path, seed=0, vocab_size=32000)
    assert len(t) == sum(s["sent"] for s in doc["stages"])  # 4,800 + 12,000
    lens = np.array([r.input_tokens for r in t.requests])
    assert abs(lens.mean() - doc["stages"][0]["prompt_tokens"]["mean"]) < 1.0
    assert all(r.output_tokens == doc["workload"]["max_tokens"] for r in t.requests)
    assert max(max(r.prompt_token_ids) for r in t.requests[:100]) < 32000


@pytest.mark.parametrize(("text", "message"), [
    ("load: {type: concurrent, stages: [{rate: 1, duration: 1}]}\ndata: {type: random}\n", "load.type 'concurrent'"),
    ("load: {stages: [{rate: 1, duration: 1}]}\ndata: {type: shareGPT}\n", "data.type 'shareGPT'"),
    ("load: {stages: [{rate: 1, duration: 1}]}\ndata: {type: shared_prefix, shared_prefix: {enable_multi_turn_chat: "
     "true}}\n", "data.shared_prefix.enable_multi_turn_chat is set"),
    ("load: {stages: []}\ndata: {type: random}\n", "load.stages must list"),
    ("load: {stages: [{rate: 1, duration: 1}]}\nbogus: 1\n", "config: bogus is not supported"),
    ("load: [1, 2\n", "not valid YAML"),
])
def test_unsupported_workloads_are_refused(tmp_path, text, message):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_workload(path)


def test_an_unsupported_workload_is_one_line_and_exit_2(tmp_path):
    """The CLI turns load_workload's UserError into one line and exit 2, before anything runs."""
    path = _write(tmp_path, "bad.yaml", "load: {type: concurrent, stages: [{rate: 1, duration: 1}]}\n")
    r = cli("run", "--device", "sim", "--workload-config", path, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "load.type 'concurrent' is not supported" in r.stderr and not (tmp_path / "o").exists()


def test_options_that_would_move_a_workloads_stages_are_refused(tmp_path):
    from harness.options import RunOptions

    path = _write(tmp_path, "w.yaml", SHARED_PREFIX)
    for extra in ({"limit": 10}, {"time_scale": 0.5}, {"start_offset": 3.0}, {"trace": path}):
        with pytest.raises(UserError, match="leave --trace, --limit, --start-offset and --time-scale out"):
            RunOptions(device="sim", workload_config=path, **extra)


def test_real_token_ids_replay_on_sim(tmp_path):
    """Ids up to the spec's vocabulary (32,000 for Llama-2-7B) run on the simulated device; past it they are
    refused as outside the vocabulary (the simulated decoder's own tokens stay in [0, 512))."""
    rng = np.random.default_rng(0)
    lines = [{"arrival_s": i * 0.01, "prompt_token_ids": [int(x) for x in rng.integers(512, 32000, 40)],
              "output_tokens": 5} for i in range(20)]
    lines.append({"arrival_s": 0.5, "prompt_token_ids": [5, 32000], "output_tokens": 5})
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    r = cli("run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-2-7b", "--trace", str(trace),
            "--strategies", "inflight", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(out / "inflight" / "requests.parquet")
    assert (df["status"] == "finished").sum() == 20
    bad = df[df["status"] == "rejected"]
    assert len(bad) == 1 and "outside the vocabulary [0, 32000)" in bad["finish_reason"].iloc[0]


# inference-perf's own dump of its effective config (a measured run's config.yaml, ../shared/validation): null and
# empty keys included, as a user hands it over
DUMPED = """\
api: {type: completion, streaming: true, headers: null}
data:
  type: shared_prefix
  path: null
  input_distribution: null
  output_distribution: null
  shared_prefix: {num_groups: 2, num_prompts_per_group: 3, system_prompt_len: 10, question_len: 20, output_len: 4}
load:
  type: constant
  interval: 1.0
  stages:
  - {rate: 4.0, duration: 5}
  sweep: null
  num_workers: 4
  worker_max_concurrency: 100
  worker_max_tcp_connections: 2500
  circuit_breakers: []
  request_timeout: null
metrics: null
report: {request_lifecycle: {summary: true, per_stage: true, per_request: true}}
storage: {local_storage: {path: /tmp/results, report_file_prefix: null}, google_cloud_storage: null}
server: {type: vllm, model_name: m, base_url: 'http://127.0.0.1:8000', ignore_eos: true, api_key: null}
tokenizer: {pretrained_model_name_or_path: m, trust_remote_code: null, token: null}
circuit_breakers: null
"""


def test_inference_perfs_dumped_config_is_accepted_as_it_writes_it(tmp_path):
    """Null and empty keys change nothing; the client's time-out (null: aiohttp's 300 s session default, which
    ended the measured reasoning run's failures at 300.0-301.0 s) and its in-flight cap (workers x concurrency)
    are honoured; a key that is set and cannot be honoured is refused by name."""
    w = load_workload(_write(tmp_path, "config.yaml", DUMPED))
    assert (w.request_timeout_s, w.max_concurrency, w.ignore_eos, len(w.stages)) == (300.0, 400, True, 1)
    t = workload_trace(w, "config.yaml", 0, 32000)
    assert (t.request_timeout_s, t.max_concurrency, len(t)) == (300.0, 400, 20)
    w = load_workload(_write(tmp_path, "t.yaml", DUMPED.replace("request_timeout: null", "request_timeout: 42.5")))
    assert w.request_timeout_s == 42.5
    for old, new, message in (("sweep: null", "sweep: {type: linear}", "load.sweep is set"),
                              ("circuit_breakers: []", "circuit_breakers: [b]", "load.circuit_breakers is set"),
                              ("\ncircuit_breakers: null", "\ncircuit_breakers: [b]", "circuit_breakers is set"),
                              ("request_timeout: null", "request_timeout: -1", "request_timeout must be seconds")):
        with pytest.raises(UserError, match=message):
            load_workload(_write(tmp_path, "bad.yaml", DUMPED.replace(old, new)))


def test_every_measured_runs_config_yaml_is_accepted(validation):
    for config in sorted(validation.parent.glob("inference-perf/*/config.yaml")):
        w = load_workload(str(config))
        assert w.request_timeout_s == 300.0 and w.data == "shared_prefix" and w.ignore_eos, config


def test_a_client_time_out_fails_the_requests_it_gives_up_on(tmp_path):
    """--request-timeout: a request not complete that long after it was sent fails with the reason, at that time,
    and the engine aborts it (its slot and KV go to the requests behind it); one that completes in time is kept."""
    out = tmp_path / "o"
    r = cli("run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-3-8b", "--strategies", "inflight,overlap",
            "--num-prompts", "24", "--request-rate", "8", "--input-len", "64", "--output-len", "400",
            "--range-ratio", "0.9", "--max-batch-size", "4", "--ignore-eos", "--request-timeout", "1.5",
            "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    for strategy in ("inflight", "overlap"):
        df = pd.read_parquet(out / strategy / "requests.parquet")
        failed, ok = df[df["status"] == "failed"], df[df["status"] == "finished"]
        assert len(failed) and len(ok), strategy
        assert failed["finish_reason"].str.startswith("timeout").all()
        assert ((failed["failed_s"] - failed["arrival_s"]) >= 1.5).all()
        assert ((failed["failed_s"] - failed["arrival_s"]) < 1.6).all()  # within a step of it
        assert (ok["e2el_ms"] < 1500 + 100).all()
        # the engine let them go: requests admitted after the first ones failed still finished
        assert ok["admitted_s"].max() > failed["failed_s"].min()

