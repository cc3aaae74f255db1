"""Executor configuration, shared by every strategy: frozen, validated once, never mutated."""

from __future__ import annotations

from dataclasses import asdict, dataclass

CAPACITY_POLICIES = ("guaranteed-no-evict", "max-utilization")
HOST_TIME = ("measured", "modelled")


@dataclass(frozen=True)
class SimConfig:
    """The simulated device (``device="sim"``): what is modelled, on what, and how host time counts."""

    gpu: str = "h200"  # a datasheet (a100, h100, h200, l40s, cpu); ignored when profile is given
    model_spec: str = "llama-3-8b"  # whose shapes the cost model uses (a spec preset or config.json dir)
    tp: int = 1  # tensor-parallel degree
    profile: str | None = None  # a calibrated device profile (JSON from `slotbench calibrate`)
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


@dataclass(frozen=True)
class ExecutorConfig:
    max_batch_size: int = 32  # requests in one iteration; also the number of slots
    max_num_tokens: int = 1024  # tokens per iteration (in-flight strategies)
    max_seq_len: int = 512  # prompt + output per request; the KV cache's length per slot
    capacity_policy: str = "guaranteed-no-evict"
    chunked_prefill: bool = False
    tokens_per_block: int = 16
    kv_blocks: int | None = None  # None: enough for every slot at max_seq_len
    device: str = "cpu"
    device_threads: int = 1  # CPU: torch threads of the device worker (the host keeps the other core)
    compile: bool = True  # run forward as one TorchScript call (GIL-free on the CPU worker)
    instrument: bool = True  # NVTX ranges (records are always kept)
    sim: SimConfig | None = None  # the simulated device's settings, when device == "sim"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.kv_blocks is not None and self.kv_blocks <= 0:
            raise ValueError(f"--kv-blocks must be positive, got {self.kv_blocks}")
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"--capacity-policy {self.capacity_policy!r}: expected one of "
                             f"{', '.join(CAPACITY_POLICIES)}")
        if self.max_num_tokens < self.tokens_per_block:
            raise ValueError(f"--max-num-tokens {self.max_num_tokens} is smaller than one KV block "
                             f"({self.tokens_per_block} tokens)")
        if self.device == "sim" and self.sim is None:
            raise ValueError("device 'sim' needs a SimConfig")
        if self.device_threads < 0:
            raise ValueError("--device-threads must be >= 0 (0: leave torch's default)")

    @property
    def total_kv_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        return self.max_batch_size * -(-self.max_seq_len // self.tokens_per_block)

    def to_dict(self) -> dict:
        return asdict(self)
