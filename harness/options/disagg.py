"""The options of a disaggregated deployment (``--strategies disagg``): its workers, their loop, the KV link."""

from __future__ import annotations

from dataclasses import dataclass

from harness.options.field import opt
from strategies.runtime.kv_transfer.config import LINKS_GBPS, WORKER_STRATEGIES, DisaggConfig


@dataclass(frozen=True)
class DisaggOptions:
    num_prefill_workers: int = opt(1, "disagg: context executors, each an engine of its own (on sim: --tp GPUs each)")
    num_decode_workers: int = opt(1, "disagg: generation executors, each an engine of its own")
    kv_transfer_buffer_mb: float = opt(64.0, "disagg: each worker's KV staging buffer (MiB): a transfer moves in "
                                             "chunks of it, one transfer at a time per worker")
    kv_link_gbps: float = opt(LINKS_GBPS["ib-400g"], "disagg, sim: prefill-to-decode link per GPU in GB/s (H100 "
                                                     "NVLink 450, 400 Gb/s InfiniBand 50, 100 GbE 12.5)")
    kv_link_latency_us: float = opt(10.0, "disagg, sim: link latency per staging-buffer chunk (us)")
    worker_strategy: str = opt("inflight", "disagg: the workers' loop: inflight (each step waited for before the "
                                           "next is scheduled) or overlap (async scheduling: the next step is "
                                           "launched first)", choices=WORKER_STRATEGIES)

    def disagg_config(self) -> DisaggConfig:
        return DisaggConfig(self.num_prefill_workers, self.num_decode_workers, self.kv_transfer_buffer_mb,
                            self.kv_link_gbps, self.kv_link_latency_us, worker_strategy=self.worker_strategy)
