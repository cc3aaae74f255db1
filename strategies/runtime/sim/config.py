"""The simulated device's settings: frozen, validated once."""

from __future__ import annotations

from dataclasses import dataclass

HOST_TIME = ("measured", "modelled")


@dataclass(frozen=True)
class SimConfig:
    """The simulated device (``device="sim"``): what is modelled, on what, and how host time counts."""

    gpu: str = "h200"  # a datasheet (a100, a40, h100, h200, l40s, cpu); ignored when profile is given
    model_spec: str = "llama-3-8b"  # whose shapes the cost model uses (a spec preset or config.json dir)
    tp: int = 1  # tensor-parallel degree
    profile: str | None = None  # a calibrated device profile (JSON from `slotbench calibrate`)
    dtype: str | None = None  # weights' and KV's dtype; None: the spec's own (config.json's torch_dtype)
    host_time: str = "measured"  # measured: real host code on the clock; modelled: the costs below
    host_ms_per_iteration: float = 0.0
    host_us_per_request: float = 0.0

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise ValueError(f"--tp must be positive, got {self.tp}")
        if self.host_time not in HOST_TIME:
            raise ValueError(f"--host-time {self.host_time!r}: expected one of {', '.join(HOST_TIME)}")
        if self.host_ms_per_iteration < 0 or self.host_us_per_request < 0:
            raise ValueError("modelled host costs must be >= 0")
