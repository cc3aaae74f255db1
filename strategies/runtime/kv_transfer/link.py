"""What a KV transfer costs on the simulated device: latency per chunk plus bytes over the link's achieved
bandwidth. Never faster than bytes / bandwidth (efficiency <= 1).

A worker is a tensor-parallel group of ``tp`` GPUs, each holding 1/tp of the KV heads and sending them over
a link of its own (TensorRT-LLM's and SGLang's transceivers send per rank), so a request's transfer takes
``bytes / tp`` per link. DistServe's simulator prices this at zero; Vidur has no disaggregation.
"""

from __future__ import annotations

from strategies.runtime.kv_transfer.config import DisaggConfig


class LinkModel:
    def __init__(self, config: DisaggConfig, tp: int = 1) -> None:
        self.bytes_per_s = config.kv_link_gbps * 1e9 * config.kv_link_efficiency * tp
        self.latency_s = config.kv_link_latency_us * 1e-6

    def transfer_s(self, nbytes: int, chunks: int) -> float:
        """Seconds to move ``nbytes`` in ``chunks`` staging-buffer chunks, one after another."""
        return chunks * self.latency_s + nbytes / self.bytes_per_s
