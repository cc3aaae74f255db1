"""The KV transceiver: pairs each handed-over request with a decode worker's preallocation and moves its KV.

A request whose first token is read on a prefill worker enters the prealloc queue (FIFO). It leaves when a
decode worker — the live one with the fewest requests — can give it a slot and blocks; its transfer then
starts. A worker's staging buffer serves one transfer at a time, so a transfer waits for both ends to be
free. The prompt's blocks move in staging-buffer chunks:

- on a real device (CPU, CUDA): the sender's ``kv_send`` piece on its stream, then the receiver's
  ``kv_recv`` piece on its; then the next chunk. Between device processes the blocks go over their gloo
  link (``kv_transfer/gloo_link.py``); in one process the host copies the sender's host half to the
  receiver's. The host polls; nothing blocks it.
- on the simulated device: nothing moves; the link model prices the chunks, and the transfer ends on the
  virtual clock when the link says.

When the last chunk has landed the sender releases its blocks and the receiver runs the request. Per
request: ``kv_transfer_start_s`` / ``kv_transfer_end_s`` (run clock) and ``kv_transfer_bytes`` (whole blocks).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from strategies.fleet import Worker
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.stream import DeviceWork
from strategies.runtime.kv_transfer.link import LinkModel
from strategies.runtime.request import Request


class WorkerDied(RuntimeError):
    def __init__(self, worker: Worker, cause: BaseException) -> None:
        super().__init__(f"{worker.label}: {cause}")
        self.worker = worker
        self.cause = cause


@dataclass(eq=False)
class Transfer:
    request: Request
    src: Worker  # its role: PrefillRole
    dst: Worker  # its role: DecodeRole
    src_blocks: np.ndarray  # [n] the prompt's blocks in the sender's pool
    dst_blocks: np.ndarray  # [n] the preallocated blocks they go to
    moved: int = 0  # blocks landed so far
    chunk: int = 0  # blocks of the chunk in flight
    work: DeviceWork | None = None  # the piece in flight (real devices)
    receiving: bool = False  # the piece in flight is the receiver's
    end_s: float = math.inf  # simulated device: when the link delivers the last chunk


class KVTransceiver:
    def __init__(self, clock: Clock, tokens_per_block: int, block_bytes: int, staging_blocks: int,
                 link: LinkModel | None, ranks: dict[Worker, int] | None = None) -> None:
        self.clock = clock
        self.tokens_per_block = tokens_per_block
        self.block_bytes = block_bytes  # bytes a block is on the link (per worker; the sim's: its TP group's)
        self.staging_blocks = staging_blocks  # blocks per chunk
        self.link = link  # None: a real device moves the bytes itself
        self.ranks = ranks  # each worker's rank on the gloo link between device processes; None: the host relays
        self.queue: deque[tuple[Request, Worker]] = deque()  # the prealloc queue
        self.active: list[Transfer] = []

    def busy(self, w: Worker) -> bool:
        return any(t.src is w or t.dst is w for t in self.active)

    def start(self, decode: list[Worker]) -> None:
        """Start every queued transfer whose sender is free and that a free decode worker has room for,
        in order; the first that finds no room stops the rest (FIFO)."""
        for entry in list(self.queue):
            r, src = entry
            if self.busy(src):
                continue
            free = sorted((d for d in decode if not self.busy(d)), key=lambda d: len(d.running) + len(d.role.receiving))
            if not free:
                return
            for dst in free:
                slot = dst.role.preallocate(r)
                if slot is not None:
                    break
            else:
                return
            self.queue.remove(entry)
            self._begin(Transfer(r, src, dst, src.kv.table[r.slot, :self._blocks(r)].copy(),
                                 dst.kv.table[slot, :self._blocks(r)].copy()))

    def _blocks(self, r: Request) -> int:
        return -(-r.prompt_len // self.tokens_per_block)

    def _begin(self, t: Transfer) -> None:
        r = t.request
        n = len(t.src_blocks)
        r.kv_transfer_start_s = self.clock.now()
        r.kv_transfer_bytes = n * self.block_bytes
        self.active.append(t)
        if self.link is not None:
            t.end_s = r.kv_transfer_start_s + self.link.transfer_s(r.kv_transfer_bytes,
                                                                   -(-n // self.staging_blocks))
        else:
            self._send(t)

    def _send(self, t: Transfer) -> None:
        t.chunk = m = min(self.staging_blocks, len(t.src_blocks) - t.moved)
        src = t.src.engine
        src.kv_staging.blocks.np[:m] = t.src_blocks[t.moved:t.moved + m]
        peer = None if self.ranks is None else self.ranks[t.dst]
        t.work, t.receiving = t.src.stream.enqueue(-1, [("kv_send", src.kv_send, (m, peer))]), False

    def _receive(self, t: Transfer) -> None:
        m, src, dst = t.chunk, t.src.engine.kv_staging, t.dst.engine.kv_staging
        dst.blocks.np[:m] = t.dst_blocks[t.moved:t.moved + m]
        # in one process the receiver uploads from the sender's host half (its send is done: the host queried
        # it), so the host's loop copies nothing (staging.py)
        peer, source = (None, src.host) if self.ranks is None else (self.ranks[t.src], None)
        t.work, t.receiving = t.dst.stream.enqueue(-1, [("kv_recv", t.dst.engine.kv_recv, (m, peer, source))]), True

    def next_event_s(self) -> float:
        """Simulated device: when the next transfer completes (inf: none in flight)."""
        return min((t.end_s for t in self.active), default=math.inf)

    def pending(self) -> bool:
        return bool(self.queue or self.active)

    def poll(self) -> list[Transfer]:
        """Advance every transfer whose piece is done; return those complete (their KV has landed). A piece
        that failed raises ``WorkerDied`` once the others are advanced and the complete ones handed over."""
        done, failure = [], None
        now = self.clock.now()
        for t in list(self.active):
            if self.link is not None:
                if t.end_s <= now:
                    done.append(t)
                continue
            while t.work is not None:
                w = t.dst if t.receiving else t.src
                if not w.stream.query(t.work):
                    break
                try:
                    w.stream.wait(t.work)
                except Exception as exc:
                    failure = failure or WorkerDied(w, exc)
                    break
                if not t.receiving:
                    self._receive(t)
                    continue
                if not t.dst.engine.kv_staging.received.np[0]:  # the sender left the link before it was sent
                    failure = failure or WorkerDied(t.src, RuntimeError(f"its KV never reached {t.dst.label}"))
                    break
                t.moved += t.chunk
                t.work = None
                if t.moved < len(t.src_blocks):
                    self._send(t)
                else:
                    done.append(t)
        for t in done:
            self.active.remove(t)
            r = t.request
            r.kv_transfer_end_s = t.end_s if self.link is not None else self.clock.now()
            t.src.role.sent(r)
            t.dst.role.received(r)
        if failure is not None:
            raise failure
        return done

    def drop(self, w: Worker) -> list[Request]:
        """``w`` died: forget its transfers. A request whose sender died is lost with its KV (its receiver's
        preallocation goes back); one whose receiver died goes back to the head of the queue, its KV still
        held by the sender, for another decode worker."""
        lost = []
        for t in [t for t in self.active if t.src is w or t.dst is w]:
            self.active.remove(t)
            if t.src is w:
                if t.dst is not w:
                    t.dst.role.cancel(t.request)
                lost.append(t.request)
            else:
                w.role.receiving.pop(t.request)
                self.queue.appendleft((t.request, t.src))
        for entry in [e for e in self.queue if e[1] is w]:
            self.queue.remove(entry)
            lost.append(entry[0])
        return lost
