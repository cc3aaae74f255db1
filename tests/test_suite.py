import json
import subprocess
import sys

import pandas as pd
import pytest

from harness.errors import UserError
from harness.suite.spec import load_suite


def write(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_unknown_keys_are_named(tmp_path):
    with pytest.raises(UserError, match="unknown key 'colour'"):
        load_suite(write(tmp_path, "colour = 1\n"))
    with pytest.raises(UserError, match=r"\[defaults\]: unknown key 'max_batch'"):
        load_suite(write(tmp_path, "[defaults]\nmax_batch = 4\n"))
    with pytest.raises(UserError, match=r"\[sweep\]: unknown key 'rate'"):
        load_suite(write(tmp_path, "[sweep]\nrate = [1, 2]\n"))
    with pytest.raises(UserError, match="max_batch_size must be an integer"):
        load_suite(write(tmp_path, "[defaults]\nmax_batch_size = '4'\n"))
    with pytest.raises(UserError, match="invalid TOML"):
        load_suite(write(tmp_path, "[defaults\n"))


def test_capacity_search_refuses_repeats(tmp_path):
    """A capacity search evaluates each rate once, so repeats (in the file or on the command line) are
    refused with one line instead of being ignored."""
    cap = '[defaults]\nmodel = "tiny"\n[capacity]\ngoodput = ["ttft:300"]\n'
    for text, args in ((f"repeats = 3\n{cap}", []), (cap, ["--repeats", "2"])):
        p = subprocess.run([sys.executable, "-m", "harness.cli", "suite", str(write(tmp_path, text)), "--out",
                            str(tmp_path / "out"), "--force", "--no-progress", *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "repeats" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not (tmp_path / "out" / "suite.json").exists()


def test_sweep_and_runs_expand(tmp_path):
    name, baseline, repeats, runs, capacity = load_suite(write(
        tmp_path, 'name = "x"\nbaseline = "inflight"\n[defaults]\nmodel = "tiny"\n[sweep]\nrequest_rate = [1.0, 2.0]\n'
                  '[[runs]]\nname = "chunked"\nchunked_prefill = true\n'))
    assert name == "x" and baseline == "inflight" and repeats == 1 and capacity is None
    assert [r[0] for r in runs] == ["request_rate=1.0", "request_rate=2.0", "chunked"]
    assert runs[1][2].request_rate == 2.0 and runs[2][2].chunked_prefill and runs[0][2].model == "tiny"


def test_suite_end_to_end(tmp_path):
    suite = write(tmp_path, '[defaults]\nmodel = "tiny"\nstrategies = "inflight,overlap"\nnum_prompts = 20\n'
                            "input_len = 16\noutput_len = 8\nmax_seq_len = 64\nwarmup = 1\n"
                            "[sweep]\nrequest_rate = [100.0, 400.0]\n")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "harness.cli", "suite", str(suite), "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    meta = json.loads((out / "suite.json").read_text())
    assert [r["name"] for r in meta["runs"]] == ["request_rate=100.0", "request_rate=400.0"]
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 4 and set(summary["run"]) == {"request_rate=100.0", "request_rate=400.0"}
    html = (out / "report.html").read_text()
    assert "Throughput and latency against request rate" in html
    for r in meta["runs"]:
        assert (out / r["dir"] / "inflight" / "requests.parquet").is_file()
