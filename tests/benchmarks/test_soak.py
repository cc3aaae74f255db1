"""Soak: 5,000 requests on ``tiny``. Not in the default run: ``python -m pytest -m soak -s tests/benchmarks``.

Measures resident memory growth after warm-up and counts tensor allocations made by the *host* thread
per iteration (schedule, prepare, postprocess) in the steady state. Device-side intermediates inside the
model's forward are PyTorch's own and are not counted here.
"""

import threading

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.runner import build_requests, run_strategy
from harness.traces import synthetic_trace
from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.models.config import PRESETS
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.soak


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class CountAllocations(TorchDispatchMode):
    """Counts ATen ops that return a fresh tensor (not a view, not in place), on this thread only."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        fresh = schema.returns and all(r.alias_info is None for r in schema.returns)
        if fresh and threading.get_ident() == self.thread and isinstance(out, torch.Tensor | tuple | list):
            self.count += 1
        return out


@pytest.mark.parametrize("name", ["inflight", "overlap"])
def test_soak_5000_requests(name):
    cfg = PRESETS["tiny"]
    model = script_model(build_model(cfg))
    ec = ExecutorConfig(max_batch_size=32, max_seq_len=128, max_num_tokens=512)
    trace = list(synthetic_trace(5000, 24, 24, range_ratio=0.5, seed=0).requests)
    warm = build_requests(trace[:200], SamplingParams(ignore_eos=True), cfg.vocab_size, 1, "w")
    run_strategy(name, cfg, model, ec, warm)
    before = rss_mb()
    reqs = build_requests(trace, SamplingParams(ignore_eos=True), cfg.vocab_size, 0)
    setup = CountAllocations()
    with setup:  # what constructing the strategy allocates (buffers, decoder state, KV)
        get_strategy(name)(cfg, model, ec).close()
    counter = CountAllocations()
    with counter:
        run = run_strategy(name, cfg, model, ec, reqs)
    after = rss_mb()
    iters = len(run.records)
    print(f"\n{name}: {len(reqs)} requests, {iters} iterations, {run.wall_s:.1f} s; RSS {before:.0f} -> {after:.0f} MB "
          f"(+{after - before:.1f} MB); host-thread tensor allocations {counter.count} "
          f"({setup.count} of them at construction)")
    assert run.error is None and all(r.num_output_tokens == r.max_new_tokens for r in reqs)
    assert after - before < 50
    assert counter.count <= setup.count  # every one at construction: none per iteration
    assert np.isfinite(run.wall_s)


def test_served_soak_20000_requests(tmp_path):
    """``slotbench serve`` (a simulated Llama-3.2-1B) answering 20,000 streamed requests from ``run --endpoint``: its
    resident memory (the front end's process and the engine's together), sampled every 0.5 s, stays within 10% of
    where it stood after the first 10% of the requests (warm-up), because what has ended is written away as it goes
    (harness/serve/spool.py)."""
    import time

    from tests.test_serve import Server
    from tests.util import child_pids, cli

    server = Server(tmp_path, "--device", "sim", "--model-spec", "llama-3.2-1b", "--gpu", "h100",
                    "--max-batch-size", "256")
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    engine = child_pids(server.proc, "spawn_main", 1)

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            rss = 0.0
            for pid in (server.proc.pid, *engine):
                with open(f"/proc/{pid}/status") as f:
                    rss += next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:"))
            samples.append((time.monotonic() - t0, rss))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        p = cli("run", "--endpoint", f"{server.url}/v1", "--model", "tiny", "--num-prompts", "20000",
                "--request-rate", "400", "--input-len", "64", "--output-len", "16", "--ignore-eos", "--warmup", "0",
                "--no-progress", "--out", str(tmp_path / "client"), timeout=1800)
        assert p.returncode == 0, p.stderr
    finally:
        stop.set()
        sampler.join()
        code, err = server.stop()
    assert code == 0, err
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples])
    warm = rss[t >= t[-1] * 0.1][0]
    every = ", ".join(f"{x:.0f}" for x in rss[:: max(1, len(rss) // 10)])
    print(f"\nserved RSS (MB) every ~{t[-1] / 10:.0f} s: {every}; after warm-up {warm:.0f}, peak {rss.max():.0f}, "
          f"last {rss[-1]:.0f}, over {t[-1]:.0f} s")
    assert rss[t >= t[-1] * 0.1].max() <= 1.10 * warm
