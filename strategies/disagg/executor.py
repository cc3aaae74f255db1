"""Disaggregated prefill and decode: P context executors and D generation executors, a KV transceiver
between them (DistServe, Splitwise, Mooncake; TensorRT-LLM's disaggregated serving, vLLM's and SGLang's
PD disaggregation).

A fleet (``strategies/fleet.py``: one host loop over engines of their own, on one clock) whose arrivals go
to the prefill workers; a prefill worker's step hands the requests whose first token it read to the
transceiver's queue, and each time round the loop the transceiver advances its transfers and starts new
ones (``transceiver.py``). On the simulated device a transfer's end is an event on the virtual clock.

Two first-token times: ``prefill_ttft`` is when the prefill worker's host reads the first token (TensorRT-LLM's
context server returns it there); ``ttft`` is when a client behind a proxy gets it — vLLM's disaggregated
proxy streams the decode instance's output, so the first token arrives with the decode worker's first output,
after the KV transfer (``DecodeRole.stream_first_tokens``). Requests on their way to a decode worker that died
go to another one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from strategies.disagg.transceiver import KVTransceiver, WorkerDied
from strategies.disagg.workers import DecodeRole, PrefillRole, staging_blocks
from strategies.fleet import Fleet, Worker
from strategies.inflight.executor import InflightStrategy
from strategies.overlap.executor import OverlapStrategy
from strategies.runtime.kv_transfer.link import LinkModel
from strategies.runtime.kv_transfer.staging import block_bytes
from strategies.runtime.request import Request

if TYPE_CHECKING:
    from torch.distributed import TCPStore


class DisaggStrategy(Fleet):
    name = "disagg"
    _link_store: TCPStore | None = None  # the gloo link's rendezvous (device processes), kept as long as the link

    def close(self) -> None:
        super().close()  # the workers' engines go, and their ends of the link with them
        self._link_store = None

    def _build(self) -> None:
        d = self.config.disagg
        cls = OverlapStrategy if d.worker_strategy == "overlap" else InflightStrategy  # --worker-strategy
        self.prefill: list[Worker] = []  # each role: PrefillRole
        self.decode: list[Worker] = []  # each role: DecodeRole
        for i in range(d.num_prefill_workers):
            self.prefill.append(cls(self.model_cfg, self.model, self.config.on(i), self.clock,
                                                 role=PrefillRole(i)))
            self.workers.append(self.prefill[-1])
        # prompts arrive by transfer, not from a cache (nor from a host tier of one)
        decode_cfg = replace(self.config, prefix_caching=False, kv_offload_blocks=0)
        for i in range(d.num_decode_workers):
            self.decode.append(cls(self.model_cfg, self.model, decode_cfg.on(d.num_prefill_workers + i), self.clock,
                                   role=DecodeRole(i)))
            self.workers.append(self.decode[-1])
        self.transceiver = self._transceiver()

    def _transceiver(self) -> KVTransceiver:
        c, d = self.config, self.config.disagg
        if c.device == "sim":  # the spec's KV; each GPU of a worker's TP group sends its share on its own link
            cost = self.prefill[0].engine.cost_model
            nbytes = c.tokens_per_block * cost.kv_bytes_per_token
            staging = max(1, d.staging_bytes * cost.tp // nbytes)
            return KVTransceiver(self.clock, c.tokens_per_block, nbytes, staging, LinkModel(d, cost.tp))
        from strategies.runtime.device.process import ProcessStream  # torch: never on the simulated device
        from strategies.runtime.kv_transfer.gloo_link import connect

        ranks = None
        if all(isinstance(w.stream, ProcessStream) for w in self.workers):  # a device process each: link them
            self._link_store = connect([w.stream for w in self.workers])
            ranks = {w: i for i, w in enumerate(self.workers)}
        else:  # one process: a decode worker uploads from a prefill worker's host half (staging.py)
            for d in self.decode:
                for p in self.prefill:
                    d.engine.kv_staging.memory.share(p.engine.kv_staging.host)
        return KVTransceiver(self.clock, c.tokens_per_block, block_bytes(self.model_cfg, c.tokens_per_block),
                             staging_blocks(self.model_cfg, c), None, ranks)

    def entry(self) -> list[Worker]:
        return [w for w in self.prefill if w in self.alive]

    def inject_fault(self, iteration: int) -> None:
        """The harness's fault hook: decode worker 0's device fails at its step ``iteration``."""
        self.decode[0].inject_fault(iteration)

    # --- the transceiver in the fleet's loop ---------------------------------------------------------
    def _pending(self) -> bool:
        return self.transceiver.pending()

    def _events_pending(self) -> bool:
        return bool(self.transceiver.active)

    def _next_event_s(self) -> float:
        return self.transceiver.next_event_s()

    def _between_steps(self) -> None:
        try:
            self.transceiver.poll()
        except WorkerDied as died:
            self._died(died.worker, died.cause, "transfer")
        self.transceiver.start([w for w in self.decode if w in self.alive])

    def _after_step(self, w: Worker) -> None:
        if isinstance(w.role, PrefillRole):
            now = self.clock.now()  # the engine's time: a client's first token may come later (--serving-path)
            for r in w.role.hand_off():
                r.kv_ready_s = now
                self.transceiver.queue.append((r, w))
        else:
            w.role.stream_first_tokens()

    def _forget(self, w: Worker) -> list[Request]:
        return self.transceiver.drop(w)
