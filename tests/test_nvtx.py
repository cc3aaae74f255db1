"""NVTX through the real tool interface: a C injection library built here, loaded by the NVTX loader."""

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("nvtx")  # one worker: its module fixture is built once

HERE = Path(__file__).parent
HOST_PHASES = {"schedule", "prepare", "postprocess"}
DEVICE_PHASES = {"forward", "sample"}


@pytest.fixture(scope="module")
def spy(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib = tmp_path_factory.mktemp("nvtx") / "libspy.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(HERE / "nvtx" / "spy_injection.c"),
                    "-lpthread"], check=True)
    return lib


def run_with_spy(spy, tmp_path, strategy, memory="shared"):
    log = tmp_path / f"{memory}.log"
    env = {**os.environ, "NVTX_INJECTION64_PATH": str(spy), "SLOTBENCH_NVTX_LOG": str(log)}
    p = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--model", "tiny", "--strategies", strategy,
                        "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--warmup", "0",
                        "--device-memory", memory, "--no-progress", "--out", str(tmp_path / f"run-{memory}")],
                       env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return log.read_text().splitlines()


def ranges_by_thread(lines):
    """Per thread: the list of (name, parent) of every completed range, checking balance."""
    stacks, done = defaultdict(list), defaultdict(list)
    for line in lines:
        parts = line.split(" ", 3)
        if parts[0] == "push":
            _, tid, domain, message = parts
            assert domain == "slotbench"
            stacks[tid].append(message)
        elif parts[0] == "pop":
            _, tid, domain = parts
            name = stacks[tid].pop()
            done[tid].append((name, stacks[tid][-1] if stacks[tid] else None))
    assert all(not s for s in stacks.values()), "unbalanced push/pop"
    return done


STRATEGIES = ("static", "inflight", "overlap")


@pytest.mark.parametrize("memory", ["shared", "split"])
def test_phase_ranges_nest_inside_iterations(spy, tmp_path, memory):
    """One run of the three strategies (one interpreter start, not three): the host's ranges on its one thread,
    the device's on a thread of the device process."""
    lines = run_with_spy(spy, tmp_path, ",".join(STRATEGIES), memory)
    assert lines[0] == "init"
    threads = ranges_by_thread(lines[1:])
    host = [t for t, r in threads.items() if any(n == "schedule" for n, _ in r)]
    device = [t for t, r in threads.items() if any(n == "forward" for n, _ in r)]
    # CPU: the device's work on a thread of its own, in the device process (each process logs an "init")
    assert len(host) == 1 and device and not set(host) & set(device)
    assert sum(line == "init" for line in lines) >= 2
    for tid, phases in [(host[0], HOST_PHASES)] + [(d, DEVICE_PHASES) for d in device]:
        ranges = threads[tid]
        iterations = sum(1 for n, _ in ranges if n == "iteration")
        assert iterations > 0
        for name, parent in ranges:
            if name == "iteration":
                assert parent is None  # iterations are top level, never stacked twice
            else:
                assert name in phases and parent == "iteration", (name, parent)
        counts = {p: sum(1 for n, _ in ranges if n == p) for p in phases}
        # every phase once per iteration (the host's idle turns schedule nothing and launch nothing)
        assert counts.get("forward", counts.get("prepare")) == counts.get("sample", counts.get("postprocess"))
        assert max(counts.values()) <= iterations
    # every step of every strategy was prepared inside a range of the host's (the three strategies' records)
    import pandas as pd

    steps = sum(len(pd.read_parquet(tmp_path / f"run-{memory}" / s / "iterations.parquet")) for s in STRATEGIES)
    assert sum(1 for n, _ in threads[host[0]] if n == "prepare") == steps


def test_no_tool_means_no_ranges(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NVTX_INJECTION64_PATH"}
    code = ("from strategies.runtime.device.nvtx import Nvtx; n = Nvtx(); n.push('schedule'); n.pop(); "
            "print(type(n._domain).__name__)")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.stdout.strip() == "DummyDomain"
