"""The KV link between the device processes of a disaggregated deployment on the CPU: a gloo group of its own
(``torch.distributed``, as the pipeline's stages have), one rank per worker's device process, the host not in
it. A send gathers the blocks into the sender's staging buffer and posts them to the receiver's rank without
waiting; the receive takes them straight into the receiver's staging buffer. No byte passes through the host
(TensorRT-LLM's transceiver sends GPU to GPU over UCX or NIXL; vLLM's NIXL connector reads the prefill
engine's blocks by RDMA), so the host's loop pays nothing for a transfer but two launches.

Failures stay with the side that failed: a device whose step raised leaves the group at once (its peers'
sends to it then fail within milliseconds instead of waiting out the timeout), and a receive whose sender
left reports it in the staging buffer's ``received`` flag instead of failing the receiver's device.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_S = 60.0  # a send or receive that waits longer fails (the peer is stuck, not just busy)


class GlooLink:
    """One device process's end of the link (built there on the host's word, kept by its engine's staging
    buffer)."""

    def __init__(self, port: int, rank: int, world: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                                   timeout=timedelta(seconds=TIMEOUT_S))
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, timedelta(seconds=TIMEOUT_S))
        self._sending: dist.Work | None = None  # the last send, posted and maybe not received yet

    def settle(self) -> None:
        """Wait until the last send has left the staging buffer, before it is written again. The host starts
        a chunk only once the previous one was received, so this returns at once, unless its receiver died
        first: then the error is that transfer's, which the host has already given up, and it is dropped."""
        work, self._sending = self._sending, None
        if work is not None:
            with contextlib.suppress(RuntimeError):
                work.wait()

    def send(self, t: torch.Tensor, peer: int) -> None:
        """Post ``t`` (the staging buffer's first blocks) to rank ``peer``; the buffer stays untouched until
        ``settle``, which must come before the buffer is written again. A receiver that already left the link
        fails the post on the spot: as in ``settle``, that is the transfer's error, which the host gives up
        with its receiver (a chunk that never arrived is reported on the receiving side, ``received``)."""
        assert self._sending is None, "settle the last send before writing the buffer again"
        with contextlib.suppress(RuntimeError):
            self._sending = self.pg.send([t], peer, 0)

    def recv(self, t: torch.Tensor, peer: int) -> bool:
        """Receive rank ``peer``'s posted blocks into ``t``; False if they never came (the sender left)."""
        try:
            self.pg.recv([t], peer, 0).wait()
        except RuntimeError:
            return False
        return True


def connect(streams: list, timeout_s: float = TIMEOUT_S) -> dist.TCPStore:
    """Form the link among the device processes behind ``streams`` (``ProcessStream``s; rank = position).
    Every process is asked before any answer is read, as the group forms only once all have joined. The
    returned store must live as long as the link."""
    store = dist.TCPStore("127.0.0.1", 0, len(streams) + 1, is_master=True,  # port 0: the OS picks one
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    for rank, s in enumerate(streams):
        s.control(("link", store.port, rank, len(streams)))
    failure = None
    for s in streams:  # every answer read, so that each process's next reply is its next request's
        try:
            s.control_reply()
        except RuntimeError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return store
