"""The KV link between disaggregated workers' device processes (``kv_transfer/gloo_link.py``): blocks go from
sender to receiver over gloo and never through the host, and a failure stays with the side that failed."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from strategies.registry import get_strategy
from strategies.runtime.kv_transfer.gloo_link import GlooLink
from strategies.runtime.request import Status
from strategies.runtime.sampling_params import SamplingParams
from tests.test_disagg import _assert_all_returned, _config, _specs
from tests.util import TINY64, ListSource, make_requests, reference_decode, run_strategy, tiny_models


def _pair() -> tuple[GlooLink, GlooLink, dist.TCPStore]:
    """Two ends of one link in this process (ranks 0 and 1; each joins from a thread of its own, as the group
    forms only once both have)."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ends: dict[int, GlooLink] = {}
    threads = [threading.Thread(target=lambda r=r: ends.__setitem__(r, GlooLink(store.port, r, 2))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return ends[0], ends[1], store


def test_blocks_arrive_as_sent():
    a, b, _store = _pair()
    sent = torch.randn(3, 2, 4, 8)  # [C, 2, L..] a staging buffer's first blocks
    got = torch.zeros_like(sent)
    a.send(sent, 1)
    assert b.recv(got, 0)
    assert torch.equal(got, sent)
    a.settle()


def test_a_receive_whose_sender_left_reports_it_at_once():
    """The sender's device failed and left the link before sending: the receiver's device is told (False)
    within seconds, not at the 60 s timeout, and does not fail."""
    a, b, _store = _pair()
    del a  # what a failed device process does (process_server: its staging buffer's link goes)
    t = time.monotonic()
    assert not b.recv(torch.zeros(4), 0)
    assert time.monotonic() - t < 10


def test_a_send_to_a_receiver_that_left_does_not_fail_the_sender():
    """The receiver died with a chunk posted to it: the sender's next send settles the old one (its error
    belongs to a transfer the host has given up) and goes on."""
    a, b, _store = _pair()
    a.send(torch.ones(4), 1)
    del b
    t = time.monotonic()
    a.settle()
    assert time.monotonic() - t < 10


def test_a_send_posted_after_its_receiver_left_does_not_fail_the_sender():
    """The receiver's step raised and it left the link before the host knew, with a chunk for it already on
    the sender's stream (CI once saw the sender die of "Connection closed by peer" here and take the run
    with it): the post fails on the spot, and that error, too, is the given-up transfer's, not the sender's.
    The sender's link goes on for its other receivers."""
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ends: dict[int, GlooLink] = {}
    threads = [threading.Thread(target=lambda r=r: ends.__setitem__(r, GlooLink(store.port, r, 3)))
               for r in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sender, gone, other = ends[0], ends[1], ends[2]
    sender.send(torch.ones(4), 1)  # a chunk it received: the pair to rank 1 is up
    assert gone.recv(torch.zeros(4), 0)
    sender.settle()
    del gone, ends[1]  # rank 1's step raised: it leaves the link
    time.sleep(0.5)
    for _ in range(3):  # the next chunk for rank 1, already queued on the sender's stream
        sender.send(torch.full((1 << 16,), 2.0), 1)
        sender.settle()
    got = torch.zeros(8)
    sender.send(torch.arange(8.0), 2)
    assert other.recv(got, 0) and torch.equal(got, torch.arange(8.0))
    sender.settle()


def test_device_processes_move_blocks_without_the_host():
    """Device processes in split memory: each engine's staging buffer has a host half (the relay path's) and a
    device half in its process. Over the link the host halves stay zero — not one byte went through the
    host — while every decoded token equals the request decoded alone."""
    _, model = tiny_models()
    requests = make_requests(_specs())
    s = run_strategy("disagg", TINY64, model, _config(device_memory="split", num_decode_workers=2), requests,
                     keep_open=True)
    try:
        assert all(not w.engine.kv_staging.host.any() for w in s.workers)
        assert s.transceiver.ranks is not None
        _assert_all_returned(s)
    finally:
        s.close()
    assert sum(r.kv_transfer_bytes for r in requests) > 0
    assert all(r.output_token_ids == reference_decode(model, TINY64, r) for r in requests)


def test_blocks_that_never_came_blame_the_sender(monkeypatch):
    """decode0's third receive reports that its blocks never came (``received`` 0: what a receive from a
    sender that left the link says; thread device, so the patch reaches it): the sender is the worker that
    failed — its requests fail with the reason — while decode0 lives on and the other prefill worker's
    requests finish with their reference tokens."""
    from strategies.runtime.kv_transfer.staging import KVStaging

    _, model = tiny_models()
    calls = []
    real = KVStaging.receive

    def lossy(self, n, k, v, peer, source=None):
        calls.append(n)
        if len(calls) == 3:
            self.received.np[0] = 0  # thread device, shared memory: the flag the host reads
            return
        real(self, n, k, v, peer, source)

    monkeypatch.setattr(KVStaging, "receive", lossy)
    requests = make_requests(_specs(16))
    s = get_strategy("disagg")(TINY64, model, _config(num_prefill_workers=2, cpu_device="thread"))
    with pytest.raises(RuntimeError, match=r"prefill\d failed: RuntimeError: its KV never reached decode0"):
        s.run(ListSource(requests))
    s.close()
    dead = {w.label for w in s.workers} - {w.label for w in s.alive}
    assert len(dead) == 1 and dead < {"prefill0", "prefill1"}
    label = dead.pop()
    failed = [r for r in requests if r.status is Status.FAILED]
    done = [r for r in requests if r.status is Status.FINISHED]
    assert failed and done and len(failed) + len(done) == len(requests)
    assert all(r.finish_reason.startswith(f"{label} failed") for r in failed)
    assert all(r.output_token_ids == reference_decode(model, TINY64, r) for r in done)


@pytest.mark.parametrize("cpu_device", ["process", "thread"])
def test_a_dead_prefill_worker_takes_no_decode_worker_with_it(cpu_device):
    """prefill0's device fails at its third step, with transfers from it posted or on their way: its
    requests fail with the reason, decode0 (their receiver) lives on, and everything prefill1 served
    finishes with its reference tokens."""
    _, model = tiny_models()
    rng = np.random.default_rng(5)
    requests = make_requests([(rng.integers(3, 60, size=int(rng.integers(20, 40))).tolist(), 12,
                               SamplingParams(temperature=0.8 * (i % 2), seed=i)) for i in range(16)])
    s = get_strategy("disagg")(TINY64, model, _config(num_prefill_workers=2, cpu_device=cpu_device))
    s.prefill[0].inject_fault(2)
    with pytest.raises(RuntimeError, match="prefill0 failed"):
        s.run(ListSource(requests))
    s.close()
    failed = [r for r in requests if r.status is Status.FAILED]
    done = [r for r in requests if r.status is Status.FINISHED]
    assert failed and done and len(failed) + len(done) == len(requests)
    assert all(r.finish_reason.startswith("prefill0 failed") for r in failed)
    assert all(r.output_token_ids == reference_decode(model, TINY64, r) for r in done)
    assert [w.label for w in s.alive] == ["prefill1", "decode0"]
