"""The device memory layer: split mode runs the CUDA path's buffers and copies on CPU, in CI.

Split mode gives the device tensors of its own; every transfer is a copy issued on the stream. These
tests check that the split device really is separate, that copies are only ever contiguous staging
prefixes, that every strategy gives the same tokens in both modes, and that launching never waits for
the device.
"""

import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import harness.runner
from harness.runner import run_strategy as harness_run
from strategies.config import ExecutorConfig
from strategies.registry import PEERS, get_strategy, strategy_names
from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.buffers.mirrored import Mirrored
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, ListSource, make_requests, reference_decode, run_strategy, tiny_models

STRATEGIES = [s for s in strategy_names() if s not in PEERS]  # every slotbench strategy, later ones too


def mixed_specs():
    """Greedy and sampled requests, some stopping at EOS, of different lengths."""
    rng = np.random.default_rng(11)
    specs = []
    for i in range(14):
        prompt = rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist()
        sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=i) if i % 3 == 0 else SamplingParams()
        specs.append((prompt, int(rng.integers(1, 20)), sampling))
    return specs


@pytest.mark.parametrize("cpu_device", ["process", "thread"])
def test_split_memory_gives_the_device_its_own_tensors(cpu_device):
    """Thread: the engine's device tensors are its own, beside the host's. Process: the host's engine holds
    only staging buffers, files both processes map, and meta placeholders where the device's tensors live
    in the device process."""
    _, scripted = tiny_models()
    s = get_strategy("overlap")(TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=64,
                                                                  device_memory="split", cpu_device=cpu_device))
    try:
        mirrored = [m for bufs in s.engine.buffer_sets for m in (
            bufs.runtime.tokens, bufs.runtime.rows, bufs.runtime.block_table, bufs.step.slots, bufs.step.admit,
            bufs.step.admit_f, bufs.step.out)]
        if cpu_device == "thread":
            host_weights = {n: p.data_ptr() for n, p in scripted.named_parameters()}
            dev_weights = {n: p.data_ptr() for n, p in s.engine.model.named_parameters()}
            assert host_weights.keys() == dev_weights.keys()
            assert not set(host_weights.values()) & set(dev_weights.values())
            assert all(m.dev is not m.host and m.dev.data_ptr() != m.host.data_ptr() for m in mirrored)
        else:
            assert all(m.dev.is_meta and not m.host.is_meta for m in mirrored)
            assert s.engine.kv.k.is_meta and s.engine.state.last_token.is_meta and s.engine.model is scripted
            assert {path for path, _, _ in s.stream.memory.staging}  # the device mapped them; the files are gone
            assert not any(Path(path).exists() for path, _, _ in s.stream.memory.staging)
    finally:
        s.close()


def test_copies_are_contiguous_staging_prefixes():
    mem = DeviceMemory(torch.device("cpu"), split=True)
    table = Mirrored(mem, (8, 3), "int64")
    table.np[:2] = [[1, 2, 3], [4, 5, 6]]
    table.upload(2)
    assert table.dev[:2].tolist() == [[1, 2, 3], [4, 5, 6]] and table.dev[2:].abs().sum() == 0
    with pytest.raises(RuntimeError, match="strided"):
        mem.upload(table.dev[:, 1], table.host[:, 1], 2)  # a column: the copy the CUDA path used to issue
    with pytest.raises(RuntimeError, match="not a staging buffer"):
        mem.upload(table.dev, torch.zeros(8, 3, dtype=torch.int64), 2)
    shared = DeviceMemory(torch.device("cpu"), split=False)
    m = Mirrored(shared, (4,), "int64")
    assert m.dev is m.host  # shared: the device reads the host's buffer, nothing is copied
    with pytest.raises(ValueError, match="always split"):
        DeviceMemory(torch.device("cuda"), split=False)


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_gives_the_same_tokens_in_shared_and_split_memory(name):
    eager, scripted = tiny_models()
    specs = mixed_specs()
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    tokens = {}
    # The pipeline's device is its stage processes, each with tensors of its own whatever --device-memory
    # says: the host's buffers reach them only as messages (tests/test_pipeline.py). One run covers it.
    for memory in ("shared", "split") if name != "pipeline" else (None,):
        for policy in ("guaranteed-no-evict", "max-utilization"):
            cfg = ExecutorConfig(max_batch_size=5, max_seq_len=64, max_num_tokens=48, tokens_per_block=4, kv_blocks=40,
                                 capacity_policy=policy, chunked_prefill=True, device_memory=memory)
            reqs = make_requests(specs)
            run_strategy(name, TINY64, scripted, cfg, reqs)
            tokens[memory, policy] = [r.output_token_ids for r in reqs]
            assert tokens[memory, policy] == expected, (memory, policy)


@pytest.mark.parametrize("name", [s for s in STRATEGIES if s != "pipeline"])  # its device is other processes
def test_launch_returns_while_the_device_is_busy(name):
    """Hold the device busy for 0.5 s, launch the next step, and see the launch return while it still is.
    A launch that waited for the device (a blocking copy, a read of a device tensor) would return only
    after the hold."""
    _, scripted = tiny_models()
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64, device_memory="split", instrument=False)
    s = get_strategy(name)(TINY64, scripted, cfg)
    launches = []

    def held(owner, launch):
        def held_launch(iteration, bufs):
            owner.stream.hold(0.5)
            t = time.perf_counter()
            work = launch(iteration, bufs)
            launches.append((time.perf_counter() - t, owner.stream.query(work)))
            return work
        return held_launch

    for owner in getattr(s, "workers", [s]):  # a fleet (disagg): every engine of it
        owner.engine.launch = held(owner, owner.engine.launch)
    reqs = make_requests([(list(range(1, 9 + i)), 6, SamplingParams(ignore_eos=True)) for i in range(6)])
    try:
        s.run(ListSource(reqs))
    finally:
        s.close()
    assert len(launches) >= 6
    assert all(not done for _, done in launches)  # the step was still queued behind the hold
    assert max(t for t, _ in launches) < 0.25
    assert all(r.num_output_tokens == 6 for r in reqs)


def test_warmup_executor_is_released_before_the_measured_run(monkeypatch):
    """Two KV pools on a card at once would halve what a run can use: the warm-up's must be gone."""
    _, scripted = tiny_models()
    pools = []
    base = get_strategy("inflight")

    class Spy(base):
        def __init__(self, *args, **kwargs):
            assert all(ref() is None for ref in pools), "an earlier executor's KV pool is still alive"
            super().__init__(*args, **kwargs)
            pools.append(weakref.ref(self.engine.kv.k))

    monkeypatch.setattr(harness.runner, "get_strategy", lambda name: Spy)
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64)
    run = harness_run("inflight", TINY64, scripted, cfg, make_requests([([1, 2, 3], 3, SamplingParams())] * 3),
                      warmup=make_requests([([4, 5], 2, SamplingParams())]))
    assert run.error is None and len(pools) == 2


def test_logits_stay_float32_whatever_the_model_dtype():
    cfg = TINY64.with_dtype("bfloat16")
    from strategies.runtime.models.llama import build_model, script_model

    model = script_model(build_model(cfg))
    s = get_strategy("inflight")(cfg, model, ExecutorConfig(max_batch_size=2, max_seq_len=32))
    try:
        assert all(b.runtime.logits.dtype == torch.float32 for b in s.engine.buffer_sets)
        assert s.engine.kv.k.dtype == torch.bfloat16
    finally:
        s.close()


def test_static_buffers_are_sized_by_the_token_budget_not_seq_len_times_batch():
    """Static's step holds the token budget, or one whole row when a prompt is longer than the budget
    (a padded row cannot be chunked): never a batch of rows at max_seq_len."""
    _, scripted = tiny_models()
    for max_seq_len, tokens in ((512, 512), (128, 256)):
        cfg = ExecutorConfig(max_batch_size=64, max_seq_len=max_seq_len, max_num_tokens=256)
        s = get_strategy("static")(TINY64, scripted, cfg)
        try:
            assert s.engine.buffer_sets[0].runtime.tokens.host.shape[0] == tokens  # not 64 x max_seq_len
        finally:
            s.close()


# scripts/gpu-check's groups in three parts on this 2-core machine, with the checks each part passes on the CPU: 36
# in all (the launch group: every strategy on Llama, BART and a mixture of experts, n-gram verify, a draft model,
# disagg's KV pieces)
GPU_CHECK_PARTS = [("spec-disagg,stream,moe", 10), ("launch,precision,tests,sync,nsys", 14), ("runs,beams,encdec", 12)]


@pytest.mark.parametrize(("groups", "checks"), GPU_CHECK_PARTS)
def test_gpu_check_script_runs_in_split_memory(groups, checks):
    """scripts/gpu-check is what a GPU machine runs; its --device cpu form runs the same checks here, every
    group of them, in parts."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"
    p = subprocess.run([sys.executable, str(script), "--device", "cpu", "--only", groups], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    passed = sum(line.startswith("PASS ") for line in lines)
    assert lines[-1] == f"{passed}/{passed} checks passed" and passed >= checks, p.stdout
    assert not any(line.startswith("FAIL ") for line in lines)


def test_gpu_check_parts_cover_every_group():
    import runpy
    from pathlib import Path

    groups = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"))["GROUPS"]
    parts = [g for part, _ in GPU_CHECK_PARTS for g in part.split(",")]
    assert sorted(parts) == sorted(groups)


def test_a_device_process_that_dies_ends_the_run_and_the_next_gets_a_new_one():
    """The device process killed mid-run: the next wait says it exited, the run stops there, and the next
    executor starts a device process of its own; tokens are still the reference's."""
    import os
    import signal

    eager, scripted = tiny_models()
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=64)
    s = get_strategy("inflight")(TINY64, scripted, cfg)
    dead = s.stream._server.proc

    def kill_at(iteration: int) -> None:
        if iteration == 3:
            os.kill(dead.pid, signal.SIGKILL)

    s.iteration_hook = kill_at
    try:
        with pytest.raises(RuntimeError, match="the device process exited"):
            s.run(ListSource(make_requests([(list(range(1, 9)), 10, SamplingParams(ignore_eos=True))] * 3)))
    finally:
        s.close()
    assert dead.poll() is not None
    reqs = make_requests(mixed_specs())
    s = run_strategy("inflight", TINY64, scripted, cfg, reqs, keep_open=True)
    try:
        assert s.stream._server.proc is not dead
    finally:
        s.close()
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(mixed_specs())]
    assert [r.output_token_ids for r in reqs] == expected


def test_a_device_process_that_died_idle_fails_at_wait_not_at_enqueue():
    """The stream's contract (device/stream.py): a failure surfaces at ``wait``. A device process killed while
    idle made the next enqueue raise instead, outside the fault handling that a fleet does at wait."""
    import os
    import signal

    from strategies.runtime.sim.engine import _nothing

    _, scripted = tiny_models()
    s = get_strategy("inflight")(TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=64))
    try:
        proc = s.stream._server.proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        work = s.stream.enqueue(0, [("nothing", _nothing, ())])  # no raise here
        with pytest.raises(RuntimeError, match="the device process exited"):
            s.stream.wait(work)
    finally:
        s.close()


def test_a_device_process_never_takes_a_new_model_for_a_freed_one_at_its_address():
    """The host keys the model a device process holds by ``model_key``, never by ``id``: CPython gives a freed
    object's address to a new one, and a device process keyed by address ran the freed model's weights for the
    new one (a TorchScript shape error in a test that ran after another in the same worker)."""
    import gc

    from strategies.runtime.device.process import model_key

    ids, keys = [], []
    for i in range(30):
        m = torch.nn.Linear(2, 2)
        model = torch.jit.script(m) if i % 2 else m
        ids.append(id(model))
        keys.append(model_key(model))
        del m, model
        gc.collect()
    assert len(set(ids)) < len(ids)  # addresses came round again (the case that broke) ...
    assert len(set(keys)) == len(keys)  # ... keys never do
    kept = torch.nn.Linear(2, 2)
    assert model_key(kept) == model_key(kept)  # (and one model keeps its key: sent once for warm-up and run)
