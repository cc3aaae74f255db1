import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from harness.errors import TraceError, UserError
from harness.traces import Fit, fit_trace, load_trace, synthetic_trace, trace_info


def test_azure_code_trace_matches_published_facts(shared_traces):
    t = load_trace(str(shared_traces / "azure2023" / "AzureLLMInferenceTrace_code.csv"))
    info = trace_info(t)
    assert t.format == "azure" and info["rows"] == 8819
    assert info["duration_s"] == pytest.approx(3436, abs=1)
    assert info["input_p50"] == 1469 and info["output_p50"] == 13
    assert t.requests[0].arrival_s == 0.0
    # 7 fractional digits survive: the first gap is 0.0520000 s exactly
    assert t.requests[1].arrival_s == pytest.approx(0.052, abs=1e-7)
    assert len(t.sha256) == 64


def test_azure_conv_and_mooncake(shared_traces):
    conv = load_trace(str(shared_traces / "azure2023" / "AzureLLMInferenceTrace_conv.csv"))
    assert len(conv) == 19366 and trace_info(conv)["output_p50"] == 129
    moon = load_trace(str(shared_traces / "mooncake" / "synthetic_trace.jsonl"))
    info = trace_info(moon)
    assert moon.format == "mooncake" and info["rows"] == 3993
    assert info["duration_s"] == pytest.approx(1022, abs=1) and info["input_p50"] == 11587
    assert 0.8 < info["interarrival_cv"] < 1.2  # the publisher's Poisson arrivals


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_burstgpt_both_layouts_skip_failed_rows(tmp_path):
    old = write(tmp_path, "old.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                "5,ChatGPT,100,20,120,Conversation log\n7,GPT-4,50,0,50,Conversation log\n9,ChatGPT,30,5,35,API log\n")
    new = write(tmp_path, "new.csv", "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,"
                "Total tokens,Log Type\n1.5,a,0.3,ChatGPT,10,4,14,Conversation log\n2.0,b,0.1,GPT-4,12,0,12,API log\n")
    a, b = load_trace(old), load_trace(new)
    assert a.format == b.format == "burstgpt"
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in a.requests] == [(0.0, 100, 20), (4.0, 30, 5)]
    assert a.skipped == 1 and b.skipped == 1 and len(b) == 1


def test_slotbench_jsonl_with_prompts_and_sampling(tmp_path):
    p = write(tmp_path, "t.jsonl", '{"arrival_s": 0.5, "prompt_token_ids": [1, 2, 3], "output_tokens": 4, '
              '"request_id": "a", "temperature": 0.7, "seed": 9}\n{"arrival_s": 1.0, "input_tokens": 8, '
              '"output_tokens": 2}\n')
    t = load_trace(p)
    assert t.format == "slotbench" and t.requests[0].prompt_token_ids == (1, 2, 3)
    assert t.requests[0].sampling == {"temperature": 0.7, "seed": 9} and t.requests[1].arrival_s == 0.5


@pytest.mark.parametrize(("name", "text", "message"), [
    ("a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,4\n", "missing column(s) GeneratedTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,abc,3\n", "a.csv:2: ContextTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,-4,3\n", "not a positive token"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,4,0\n", "not a positive token"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,4,3\n", "a.csv:2: TIMESTAMP"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,4,3\n2023-11-16 18:17:04", "a.csv:3"),
    ("b.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 1, "input_len', "b.jsonl:2"),
    ("b.jsonl", '{"timestamp": "NaN", "input_length": 5, "output_length": 3}\n', "not finite"),
    ("b.jsonl", '{"timestamp": 0, "input_length": 5}\n', "b.jsonl:1: missing key(s) output_length"),
    ("b.jsonl", '{"time": 0}\n', "cannot detect"),
    ("c.jsonl", '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 2, "colour": 1}\n', "unknown key(s) colour"),
    ("c.jsonl", '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 2, "temperature": -1}\n',
     "c.jsonl:1: temperature must be >= 0"),
    ("c.jsonl", '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 2, "seed": "x"}\n',
     "seed: 'x' is not an integer"),
    ("c.jsonl", '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 2, "request_id": "a"}\n'
     '{"arrival_s": 1, "input_tokens": 5, "output_tokens": 2, "request_id": 7}\n'
     '{"arrival_s": 2, "input_tokens": 5, "output_tokens": 2, "request_id": "a"}\n',
     "c.jsonl:3: request_id 'a' repeats line 1"),
    ("d.csv", "", "empty file"),
    ("e.csv", "foo,bar\n1,2\n", "cannot detect"),
])
def test_bad_trace_files_name_file_line_and_problem(tmp_path, name, text, message):
    p = write(tmp_path, name, text)
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    assert message in str(exc.value) and name in str(exc.value)
    assert "\n" not in str(exc.value)


def test_missing_path_directory_and_format_override(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "nope.csv"))
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(str(tmp_path))
    p = write(tmp_path, "x.txt", '{"timestamp": 0, "input_length": 5, "output_length": 3}\n')
    with pytest.raises(TraceError, match="unknown trace format 'csv'; valid: auto, azure"):
        load_trace(p, "csv")
    assert load_trace(p, "mooncake").format == "mooncake"


def test_unsorted_timestamps_are_sorted_with_one_note(tmp_path):
    p = write(tmp_path, "u.jsonl", "".join(f'{{"timestamp": {t}, "input_length": 5, "output_length": 3}}\n'
                                             for t in (3000, 1000, 2000)))
    t = load_trace(p)
    assert [r.arrival_s for r in t.requests] == [0.0, 1.0, 2.0]
    assert len(t.notes) == 1 and "sorted" in t.notes[0]


def test_fit_options():
    t = synthetic_trace(50, 100, 40, request_rate=10.0, seed=1)
    f = fit_trace(t, Fit(start_offset_s=1.0, limit=10, time_scale=0.5, length_scale=0.5, max_input_len=30))
    assert len(f) == 10 and f.requests[0].arrival_s == 0.0
    src = [r for r in t.requests if r.arrival_s >= 1.0][:10]
    assert f.requests[-1].arrival_s == pytest.approx((src[-1].arrival_s - src[0].arrival_s) * 0.5)
    assert all(r.input_tokens == 30 and r.output_tokens == 20 for r in f.requests)
    with pytest.raises(UserError, match="time-scale"):
        Fit(time_scale=0)


def test_synthetic_rate_burstiness_and_lengths():
    t = synthetic_trace(4000, 100, 50, request_rate=20.0, burstiness=1.0, range_ratio=0.5, seed=3)
    arr, inp, out = t.arrays()
    gaps = np.diff(arr)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # Poisson: CV 1
    bursty = np.diff(synthetic_trace(4000, 100, 50, request_rate=20.0, burstiness=0.25, seed=3).arrays()[0])
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma(k): CV 1/sqrt(k)
    assert inp.min() >= 50 and inp.max() <= 150 and out.min() >= 25 and out.max() <= 75
    assert synthetic_trace(5, 10, 5, seed=3).arrays()[0].tolist() == [0.0] * 5  # rate inf
    assert synthetic_trace(10, 10, 5, seed=3) == synthetic_trace(10, 10, 5, seed=3)
    for dist in ("normal", "lognormal", "zipf"):
        x = synthetic_trace(500, 64, 8, length_dist=dist, range_ratio=0.3, seed=0).arrays()[1]
        assert x.min() >= 1 and 30 < np.median(x) < 100, dist
    with pytest.raises(UserError, match="request-rate"):
        synthetic_trace(5, 10, 5, request_rate=-1)


@pytest.mark.parametrize("line", [
    '{"arrival_s": 0.0, "input_tokens": 1000000000000, "output_tokens": 8}',
    '{"arrival_s": 0.0, "input_tokens": 8, "output_tokens": 1000000000000}',
    '{"timestamp": 0, "input_length": 1000000000000, "output_length": 8, "hash_ids": [1, 2]}',
])
def test_a_line_claiming_a_trillion_tokens_is_sized_before_it_is_trusted(tmp_path, line):
    """The claim is rejected from its size: nothing proportional to it is allocated (peak RSS stays that
    of a small run), the other requests run, no traceback."""
    trace = tmp_path / "t.jsonl"
    other = line.replace("1000000000000", "8")
    trace.write_text(f"{other}\n{line}\n{other}\n")
    out = tmp_path / "out"
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.stderr.write(p.stderr)")
    p = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "harness.cli", "run", "--model", "tiny",
                        "--trace", str(trace), "--max-seq-len", "64", "--warmup", "0", "--no-progress",
                        "--strategies", "inflight,static", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    returncode, max_rss_kib = map(int, p.stdout.split())
    assert "Traceback" not in p.stderr
    if returncode == 2:  # refusing the whole file is allowed: one clear line
        assert len(p.stderr.strip().splitlines()) == 1
    else:
        assert returncode == 0, p.stderr
        for strategy in ("inflight", "static"):
            req = pd.read_parquet(out / strategy / "requests.parquet")
            assert list(req["status"]) == ["finished", "rejected", "finished"]
            assert "max_seq_len" in req["finish_reason"].iloc[1]
    assert max_rss_kib < 2 * 1024 * 1024, f"peak RSS {max_rss_kib / 1024:.0f} MiB"


def test_random_prompt_ids_are_the_seeded_stream_drawn_prompt_by_prompt():
    """Prompts are cut from draws of many ids at a time; they must be the ids that drawing each prompt's
    random part on its own, in turn, gives from the same seed (what a run's prompts were before, and what
    numpy's generator gives), across prompts, encoder inputs, prefix-block remainders and the pool's refills."""
    from harness.traces.prompts import POOL_IDS, PromptBuilder
    from harness.traces.trace import TraceRequest

    vocab, seed = 128256, 11
    trace = [TraceRequest(0.0, 512, 1), TraceRequest(0.0, 7, 1, encoder_tokens=33),
             TraceRequest(0.0, POOL_IDS + 5, 1), TraceRequest(0.0, 40, 1, prefix_ids=(3,), prefix_block_len=16),
             TraceRequest(0.0, 1, 1), TraceRequest(0.0, POOL_IDS - 3, 1)]
    builder, rng = PromptBuilder(vocab, seed), np.random.default_rng(seed)
    for t in trace:
        prompt = builder.prompt(t)
        random_part = prompt[16:] if t.prefix_ids else prompt  # the prefix block's tokens are its own stream
        assert np.array_equal(random_part, rng.integers(0, vocab, size=len(random_part), dtype=np.int64))
        if t.encoder_tokens:
            assert np.array_equal(builder.encoder_prompt(t), rng.integers(0, vocab, size=33, dtype=np.int64))
