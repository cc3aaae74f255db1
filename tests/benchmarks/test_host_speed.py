"""Issue 27's figures, whole commands as a user runs them: the 200-request simulated run, docs/simulator.md's 70B
run (and its measured host time per iteration), the CPU device's default run (inflight's host time per
iteration, beside the same host code between simulated steps, back to back and each after a wait), how
many distinct step shapes the 70B run's cost model priced, and what a wait does to the host's next array
operations. Each command runs ``ROUNDS`` times and the best is kept (machines are shared). Seconds on the
clock depend on the machine, so the test command leaves these out: ``python -m pytest -m speed -s
tests/benchmarks/test_host_speed.py`` prints each figure; the bounds are the figures measured when the
work landed plus headroom, to catch a regression, not the issue's goals (docs/benchmarks.md's "Host speed"
section gives both)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROUNDS = 3
SLOTBENCH = [sys.executable, "-c", "from harness.cli import entry; entry()"]  # what the `slotbench` script runs
RUN_200 = ["--device", "sim", "--gpu", "h100", "--model-spec", "llama-3-8b", "--request-rate", "5",
           "--num-prompts", "200", "--host-time", "modelled", "--strategies", "inflight"]
RUN_70B = ["--device", "sim", "--gpu", "h200", "--model-spec", "llama-3-70b", "--tp", "4", "--request-rate", "18",
           "--num-prompts", "10000", "--input-len", "512", "--output-len", "256", "--max-batch-size", "256",
           "--max-seq-len", "2048", "--max-num-tokens", "8192", "--ignore-eos", "--strategies", "inflight"]


# The simulated device as above, its host waiting WAIT_S of real time for each step as a device's host does
# (spinning, off the virtual clock): no device process, no torch, the same host code and requests.
SPIN_WAIT = """import os, time
from strategies.runtime.sim.device import SimStream
wait, spin_s = SimStream.wait, float(os.environ["WAIT_S"])
def spinning(self, work):
    t = self.clock.stop()
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        pass
    self.clock.resume(t)
    return wait(self, work)
SimStream.wait = spinning
from harness.cli import entry
entry()"""


def _best_run(args: list[str], out: Path, command: list[str] = SLOTBENCH,
              env: dict[str, str] | None = None) -> tuple[float, pd.DataFrame]:
    """The fastest of ``ROUNDS`` whole commands (seconds), and that run's summary. Python caches the
    compiled modules as a user's installation does (with PYTHONDONTWRITEBYTECODE set, as in this machine's
    environment, every command compiles ~100 of slotbench's modules again: ~0.15 s)."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, **(env or {})}
    best, summary = float("inf"), None
    for i in range(ROUNDS):
        d = out / f"r{i}"
        t = time.perf_counter()
        p = subprocess.run([*command, "run", *args, "--out", str(d)], capture_output=True, text=True, timeout=600,
                           env=env)
        took = time.perf_counter() - t
        assert p.returncode == 0, p.stderr[-2000:]
        if took < best:
            best, summary = took, pd.read_csv(d / "summary.csv")
    return best, summary


@pytest.mark.speed
def test_200_request_run(benchmark, tmp_path):
    benchmark(lambda: None)  # a figure, not a pytest-benchmark timing
    seconds, _ = _best_run(RUN_200, tmp_path)
    print(f"\n200-request simulated run, whole command: {seconds:.2f} s (goal 3 s)")
    assert seconds <= 3.0  # 2.0 s best of 3 at 8cd5eb1, 2.1 s at dda377b; 3.5-4.2 s with torch's import


@pytest.mark.speed
def test_70b_run(benchmark, tmp_path):
    benchmark(lambda: None)
    seconds, summary = _best_run(RUN_70B, tmp_path)
    host_ms = float(summary["host_ms_per_iteration"].iloc[0])
    it = pd.read_parquet(next(tmp_path.glob("r*/inflight/iterations.parquet")))
    shapes = len(it[["num_tokens", "num_samples", "num_encoder_tokens"]].drop_duplicates())
    print(f"\n70B / TP4 / H200, 10,000 requests, whole command: {seconds:.2f} s (goal 8 s); host "
          f"{host_ms:.3f} ms per iteration (goal 0.3); {len(it):,} steps priced from {shapes:,} distinct shapes")
    # 7.4-7.6 s and 0.30-0.32 ms best of 3 at 8cd5eb1 (8.6 s and 0.335 ms at dda377b; 0.40-0.44 ms before the
    # progress book)
    assert seconds <= 11.0 and host_ms <= 0.36
    assert shapes < len(it) / 2  # the cost model's shape cache pays


@pytest.mark.speed
def test_cpu_default_run_host_time(benchmark, tmp_path):
    """Beside the CPU device's figure, the same host code over the same requests on the simulated device
    (host time measured there too), once with its steps following one another within microseconds and
    once with the host spinning for the CPU run's median wait before each step's outputs, as a device's host
    does, with no device process and no torch anywhere. The wait alone brings the host's time to the CPU
    device's (0.245-0.503 against 0.265-0.444 ms in five runs at 4e582ca, back to back 0.144-0.225): after
    10-20 ms of anything else the host's code is no longer in the core's caches (docs/benchmarks.md, "Host speed")."""
    benchmark(lambda: None)
    _, summary = _best_run(["--strategies", "inflight"], tmp_path / "cpu")
    host_ms = float(summary["host_ms_per_iteration"].iloc[0])
    wait_s = float(pd.read_parquet(tmp_path / "cpu" / "r0" / "inflight" / "iterations.parquet")["wait_s"].median())
    sim = ["--strategies", "inflight", "--device", "sim"]
    _, warm = _best_run(sim, tmp_path / "sim")
    warm_ms = float(warm["host_ms_per_iteration"].iloc[0])
    _, spun = _best_run(sim, tmp_path / "spin", [sys.executable, "-c", SPIN_WAIT], {"WAIT_S": str(wait_s)})
    spun_ms = float(spun["host_ms_per_iteration"].iloc[0])
    print(f"\nCPU device, default run: inflight host {host_ms:.3f} ms per iteration (goal 0.15); the same host "
          f"code and requests between simulated steps: {warm_ms:.3f} ms, and after a {wait_s * 1e3:.1f} ms spin "
          f"for each step (no device): {spun_ms:.3f} ms")
    assert host_ms <= 0.6 and warm_ms <= 0.35 and spun_ms <= 0.7


@pytest.mark.speed
def test_host_ops_after_a_wait(benchmark):
    """Why the CPU device's host time is above the simulated device's for the same code: a few array
    operations of the kind a step's postprocess runs (a 29-row hand-out's first ones), timed back to back
    and after 1, 3 and 12 ms of other work — a Python loop in the same thread, no device and no other
    process involved — as a host's phases follow the wait for a step. The longer the wait, the slower they
    run after it: what the host had in the core's caches is lost a little more each millisecond. What is
    lost is the code more than the data: after the 12 ms, reading the arrays' bytes first leaves the
    operations about as slow, running the same operations over other arrays first makes them nearly as fast
    as back to back."""
    benchmark(lambda: None)
    out, key = np.zeros((29, 2), np.int64), np.arange(64, dtype=np.int64)
    slots = np.arange(29)
    keys = key[slots].copy()
    other = np.zeros(29, np.int64)

    def ops() -> float:
        t = time.perf_counter()
        fast = out[:, 1] == 0
        fast &= key[slots] == keys
        slots[fast].tolist()
        return time.perf_counter() - t

    def wait(ms: float) -> None:  # anything but these operations
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1e3:
            pass

    def data() -> None:  # the arrays' bytes, read without an array operation
        for a in (out, key, slots, keys):
            bytes(a.data)

    def code() -> None:  # the same operations over another array
        f = other == 0
        f &= other[other] == other
        other[f].tolist()

    figures, cold_of = [], {}
    for wait_ms, before, what in ((1, None, ""), (3, None, ""), (12, None, ""), (12, data, " and the data read"),
                                  (12, code, " and the code run")):
        hot, cold = [], []
        for _ in range(2400 // wait_ms):
            hot.append(ops())
            wait(wait_ms)
            if before is not None:
                before()
            cold.append(ops())
        hot_us, cold_us = np.median(hot) * 1e6, np.median(cold) * 1e6
        figures.append(f"{cold_us:.1f} us after {wait_ms} ms{what} ({cold_us / hot_us:.1f}x)")
        cold_of[wait_ms, what] = cold_us
        assert hot_us < 50
    print(f"\nthree array operations over 29 rows: {hot_us:.1f} us back to back; {', '.join(figures)}")
    # What docs/benchmarks.md concludes from these figures ("Host speed"), as ratios of one run: the
    # longer the wait the slower the operations after it, and what the wait loses is code more than data
    # (running the same operations elsewhere first restores more than reading the arrays' bytes does)
    assert cold_of[1, ""] < cold_of[3, ""] < cold_of[12, ""] and cold_of[12, ""] > 2 * cold_of[1, ""], figures
    assert cold_of[12, " and the code run"] < cold_of[12, " and the data read"], figures
