"""Simulator fidelity: calibrate on a real CPU run of ``small``, simulate the same trace with the same
settings, compare. Both forms are benchmarks of a real CPU run's timing, which a shared 2-core machine moves
by ±20% run to run, so the test command leaves them out: ``python -m pytest -m fidelity -s`` runs the full
one (three strategies, throughput and latencies within 10%) and the reduced one (half the requests, two
strategies, saturated, throughput within 15%; seen: up to 8%), printing every error. CI checks the path
itself — calibrate on a real run, simulate it — on ``tiny`` in tests/test_sim.py."""

import subprocess
import sys

import pandas as pd
import pytest

COMMON = ["--request-rate", "30", "--input-len", "128", "--output-len", "64", "--range-ratio", "0.5",
          "--max-batch-size", "32", "--ignore-eos", "--seed", "3", "--no-progress"]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr
    return p.stdout


def simulation_errors(tmp_path, *args: str) -> dict[tuple[str, str], float]:
    """Relative error of the simulated run against the real one it was calibrated on, per (strategy, metric)."""
    real, sim = tmp_path / "real", tmp_path / "sim"
    cli("run", "--model", "small", *COMMON, *args, "--out", str(real))
    print(cli("calibrate", str(real)))
    cli("run", "--device", "sim", "--profile", str(real / "device-profile.json"), "--model-spec", "small", *COMMON,
        *args, "--warmup", "0", "--out", str(sim))
    a = pd.read_csv(real / "summary.csv").set_index("strategy")
    b = pd.read_csv(sim / "summary.csv").set_index("strategy")
    errors = {}
    for s in a.index:
        for m in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            errors[s, m] = err = b.loc[s, m] / a.loc[s, m] - 1
            print(f"{s:>8} {m:<18} real {a.loc[s, m]:10.3f}  sim {b.loc[s, m]:10.3f}  error {err:+.1%}")
    return errors


@pytest.mark.fidelity
def test_simulated_throughput_within_15_percent_of_real_small_reduced(tmp_path):
    # Twice the rate `small` sustains here, so throughput is the device's, not the arrivals'.
    errors = simulation_errors(tmp_path, "--num-prompts", "150", "--request-rate", "60",
                               "--strategies", "static,inflight")
    assert all(abs(e) <= 0.15 for (_, m), e in errors.items() if m == "output_throughput"), errors


@pytest.mark.fidelity
def test_simulation_within_10_percent_of_real_small(tmp_path):
    errors = simulation_errors(tmp_path, "--num-prompts", "300")
    assert max(abs(e) for e in errors.values()) <= 0.10
