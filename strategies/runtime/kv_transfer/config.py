"""The disaggregated deployment's settings: workers on each side, the staging buffer, the link. Frozen,
validated once."""

from __future__ import annotations

from dataclasses import dataclass

# Per-GPU bandwidth of one direction of common links (GB/s), for --kv-link-gbps and the docs:
LINKS_GBPS = {
    "nvlink-h100": 450.0,  # NVLink 4: 900 GB/s per GPU, both directions together
    "ib-400g": 50.0,  # one 400 Gb/s InfiniBand NDR NIC per GPU (DGX H100's arrangement)
    "eth-100g": 12.5,  # one 100 GbE NIC per GPU
}
WORKER_STRATEGIES = ("inflight", "overlap")  # a worker's loop: the engine core's depth 1 or 2


@dataclass(frozen=True)
class DisaggConfig:
    num_prefill_workers: int = 1  # context executors (each its own engine: slots, KV pool, buffers)
    num_decode_workers: int = 1  # generation executors
    # Bounded staging buffer on each side (TensorRT-LLM's CacheTransBufferManager): a request's KV goes
    # through it in chunks of at most this many MiB, one transfer at a time per worker
    kv_transfer_buffer_mb: float = 64.0
    # Simulated link between a prefill and a decode worker, per GPU of a worker's tensor-parallel group
    # (each GPU sends its own heads' KV over its own link): bandwidth in GB/s, latency per chunk, and the
    # share of the bandwidth a transfer achieves. Default: 400 Gb/s InfiniBand.
    kv_link_gbps: float = LINKS_GBPS["ib-400g"]
    kv_link_latency_us: float = 10.0
    kv_link_efficiency: float = 0.85
    worker_strategy: str = "inflight"  # every worker's loop (``WORKER_STRATEGIES``)

    def __post_init__(self) -> None:
        if self.num_prefill_workers <= 0 or self.num_decode_workers <= 0:
            raise ValueError("--num-prefill-workers and --num-decode-workers must be positive")
        if not self.kv_transfer_buffer_mb > 0:
            raise ValueError(f"--kv-transfer-buffer-mb must be positive, got {self.kv_transfer_buffer_mb}")
        if not self.kv_link_gbps > 0:
            raise ValueError(f"--kv-link-gbps must be positive, got {self.kv_link_gbps}")
        if not self.kv_link_latency_us >= 0:
            raise ValueError(f"--kv-link-latency-us must be >= 0, got {self.kv_link_latency_us}")
        if self.worker_strategy not in WORKER_STRATEGIES:
            raise ValueError(f"--worker-strategy must be one of {', '.join(WORKER_STRATEGIES)}, "
                             f"got {self.worker_strategy!r}")
        if not 0 < self.kv_link_efficiency <= 1:
            raise ValueError(f"kv_link_efficiency must be in (0, 1], got {self.kv_link_efficiency}")

    @property
    def staging_bytes(self) -> int:
        return int(self.kv_transfer_buffer_mb * 2**20)
