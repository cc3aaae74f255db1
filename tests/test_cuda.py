"""The CUDA path's logic, run where the hardware is: on a GPU, and in split memory on the CPU.

Split memory runs the same buffers, copies and stream order as CUDA with the device's tensors in host
RAM, so every check here that does not need a GPU runs in CI. Only the ``cuda`` cases skip without one.
"""

import itertools

import pytest
import torch

from harness.runner import _cuda_profiler_range
from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.factory import make_stream
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.sampling_params import SamplingParams
from tests.device_pieces import fail, note
from tests.util import TINY64, ListSource, make_requests, run_strategy, tiny_models

DEVICES = ["cpu-split", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs a CUDA GPU"))]


def specs():
    return [(list(range(1 + i, 30 + 3 * i)), 20, SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i,
                                                                 ignore_eos=True)) for i in range(12)]


def run_on(device, name):
    dev = "cpu" if device == "cpu-split" else "cuda"
    model = script_model(build_model(TINY64, dev))
    cfg = ExecutorConfig(max_batch_size=6, max_seq_len=128, device=dev, device_memory="split")
    reqs = make_requests(specs())
    return run_strategy(name, TINY64, model, cfg, reqs, keep_open=True), reqs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["static", "inflight", "overlap"])
def test_device_tokens_equal_shared_cpu_tokens(device, name):
    ref = make_requests(specs())
    run_strategy(name, TINY64, script_model(build_model(TINY64)), ExecutorConfig(max_batch_size=6, max_seq_len=128),
                 ref)
    s, reqs = run_on(device, name)
    try:
        assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]
        # The engine's own staging buffers: pinned on CUDA; on either, distinct from the device's.
        for bufs in s.engine.buffer_sets:
            for m in (bufs.runtime.tokens, bufs.step.out):
                assert m.dev.data_ptr() != m.host.data_ptr()
                assert m.host.is_pinned() == (device == "cuda")
        # Device times on the run clock: ordered, and inside the run (the clock starts after the build).
        recs = s.records
        assert all(r.forward_start_s <= r.forward_end_s <= r.sample_start_s <= r.sample_end_s for r in recs)
        assert all(b.forward_start_s >= a.sample_end_s for a, b in itertools.pairwise(recs))
        # A step cannot start on the device before the host has prepared it and handed it over. (Not
        # ``launch_s``: CUDA records a step's start event while launch() is still issuing its kernels, and
        # the CPU worker may start it before launch() returns.) CUDA times are mapped onto the run clock
        # through an event read after it completed, so they are never early.
        assert all(r.forward_start_s >= r.prepare_end_s for r in recs)
        assert recs[0].forward_start_s >= 0
    finally:
        s.close()


# The stream contract on every device: the CPU as a device process and as a thread, and CUDA
STREAMS = ["cpu-process", "cpu-thread", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                       reason="needs a CUDA GPU"))]


def device_config(device: str) -> dict:
    if device == "cuda":
        return {"device": "cuda"}
    return {"device": "cpu", "cpu_device": device.removeprefix("cpu-"), "device_memory": "split"}


def strategy_on(device: str, name: str = "inflight"):
    """A built strategy of the tiny model on ``device``: its stream ready, its engine on the device."""
    return get_strategy(name)(TINY64, tiny_models()[1], ExecutorConfig(max_batch_size=4, max_seq_len=64,
                                                                       **device_config(device)))


@pytest.mark.parametrize("device", STREAMS)
def test_work_before_ready_is_refused(device):
    c = device_config(device)
    stream = make_stream(c["device"], Clock(), Nvtx(False), memory="split", cpu_device=c.get("cpu_device", "process"))
    try:
        with pytest.raises(RuntimeError, match="before the engine's tensors were marked ready"):
            stream.hold(0.0)
    finally:
        stream.close()
    s = strategy_on(device)  # built: the engine marked its tensors ready
    try:
        s.stream.wait(s.stream.hold(0.0))
    finally:
        s.close()


@pytest.mark.parametrize("device", STREAMS)
def test_a_failure_surfaces_at_wait_and_poisons_the_stream(device, tmp_path):
    """The same on every device (the code is DeviceStream's): enqueue returns, wait raises, and nothing
    enqueued after the failure runs."""
    s = strategy_on(device)
    ran = tmp_path / "ran"
    try:
        failing = s.stream.enqueue(0, [("forward", fail, ())])  # returns: the failure is the device's
        later = s.stream.enqueue(1, [("forward", note, (str(ran),))])
        with pytest.raises(RuntimeError, match="boom"):
            s.stream.wait(failing)
        with pytest.raises(RuntimeError, match="boom"):
            s.stream.wait(later)
        assert not ran.exists()
    finally:
        s.close()


@pytest.mark.parametrize("device", STREAMS)
@pytest.mark.parametrize("name", ["inflight", "overlap"])
def test_an_engine_fault_surfaces_at_wait_not_at_launch(device, name):
    s = strategy_on(device, name)
    s.inject_fault(2)
    launched = []
    launch = s.engine.launch

    def spy(iteration, bufs):
        work = launch(iteration, bufs)  # raises nothing, even for the step that fails
        launched.append(iteration)
        return work

    s.engine.launch = spy
    try:
        with pytest.raises(RuntimeError, match="injected engine fault at iteration 2"):
            s.run(ListSource(make_requests([(list(range(1, 9)), 8, SamplingParams(ignore_eos=True))] * 3)))
    finally:
        s.close()
    assert 2 in launched


@pytest.mark.parametrize("device", STREAMS)
def test_close_returns_once_nothing_is_queued(device, tmp_path):
    """After close the engine's tensors may be freed: nothing may still run on them."""
    s = strategy_on(device)
    ran = tmp_path / "ran"
    s.stream.hold(0.3)
    last = s.stream.enqueue(1, [("forward", note, (str(ran),))])
    s.close()
    assert ran.exists()
    if device == "cuda":  # the hold's kernel and the work after it have completed
        assert last.events[-1][2].query()


@pytest.mark.parametrize("device", DEVICES)
def test_place_gives_the_device_a_copy_and_leaves_the_callers_model_alone(device):
    """(A device process loads a copy of its own from bytes: buffers/process_memory.py.)"""
    dev = "cpu" if device == "cpu-split" else "cuda"
    host = build_model(TINY64)
    before = {n: (p.data_ptr(), p.device) for n, p in host.named_parameters()}
    placed = DeviceMemory(torch.device(dev), split=True).place(host)
    assert placed is not host and {p.device.type for p in placed.parameters()} == {dev}
    assert {n: (p.data_ptr(), p.device) for n, p in host.named_parameters()} == before
    assert not {p.data_ptr() for p in placed.parameters()} & {ptr for ptr, _ in before.values()}
    assert DeviceMemory(torch.device("cpu"), split=False).place(host) is host  # shared: the host's own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_stream_orders_its_work_after_the_engines_construction():
    """Hold the default stream busy, then build the engine: its KV pools and decoder state are filled on
    the default stream behind the hold. Steps issued on the engine's stream at once must wait for those
    fills (a prefill written before the KV pool's zero-fill ran would be wiped): tokens equal the CPU's."""
    ref = make_requests(specs())
    run_strategy("inflight", TINY64, script_model(build_model(TINY64)), ExecutorConfig(max_batch_size=6,
                                                                                      max_seq_len=128), ref)
    model = script_model(build_model(TINY64, "cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of the default stream
    reqs = make_requests(specs())
    run_strategy("inflight", TINY64, model, ExecutorConfig(max_batch_size=6, max_seq_len=128, device="cuda"), reqs)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]


def test_the_profiler_range_brackets_the_iterations_asked_for(monkeypatch):
    """``--profile-iters A-B``: cudaProfilerStart as iteration A starts, Stop as B+1 does (the hook's own
    code, with the two CUDA calls recorded instead of made)."""
    calls = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append(("start", iteration[0])))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append(("stop", iteration[0])))
    hook = _cuda_profiler_range(3, 5)
    iteration = [0]

    def on_iteration(i: int) -> None:
        iteration[0] = i
        hook(i)

    s = get_strategy("inflight")(TINY64, tiny_models()[1], ExecutorConfig(max_batch_size=4, max_seq_len=64))
    s.iteration_hook = on_iteration
    try:
        s.run(ListSource(make_requests([(list(range(1, 9)), 10, SamplingParams(ignore_eos=True))] * 2)))
    finally:
        s.close()
    assert len(s.records) > 6 and calls == [("start", 3), ("stop", 6)]
