"""Simulator fidelity benchmark (issue #8): calibrate on a real CPU run of ``small``, simulate the same
trace with the same settings, compare. Not in the default run: ``python -m pytest -m fidelity -s``."""

import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.fidelity

COMMON = ["--num-prompts", "300", "--request-rate", "30", "--input-len", "128", "--output-len", "64",
          "--range-ratio", "0.5", "--max-batch-size", "32", "--ignore-eos", "--seed", "3", "--no-progress"]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_simulation_within_10_percent_of_real_small(tmp_path):
    real, sim = tmp_path / "real", tmp_path / "sim"
    cli("run", "--model", "small", *COMMON, "--out", str(real))
    print(cli("calibrate", str(real)))
    cli("run", "--device", "sim", "--profile", str(real / "device-profile.json"), "--model-spec", "small", *COMMON,
        "--warmup", "0", "--out", str(sim))
    a = pd.read_csv(real / "summary.csv").set_index("strategy")
    b = pd.read_csv(sim / "summary.csv").set_index("strategy")
    worst = 0.0
    for s in ("static", "inflight", "overlap"):
        for m in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            err = b.loc[s, m] / a.loc[s, m] - 1
            worst = max(worst, abs(err))
            print(f"{s:>8} {m:<18} real {a.loc[s, m]:10.3f}  sim {b.loc[s, m]:10.3f}  error {err:+.1%}")
    assert worst <= 0.10
