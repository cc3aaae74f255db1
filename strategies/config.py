"""Executor configuration, shared by every strategy: frozen, validated once, never mutated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from strategies.runtime.buffers.mirrored import MEMORY_MODES
from strategies.runtime.device.factory import CPU_DEVICES
from strategies.runtime.kv_transfer.config import DisaggConfig
from strategies.runtime.sim.config import SimConfig
from strategies.runtime.spec.config import SpecConfig

CAPACITY_POLICIES = ("guaranteed-no-evict", "max-utilization")
ROUTERS = ("least-tokens", "round-robin")


@dataclass(frozen=True)
class ExecutorConfig:
    max_batch_size: int = 32  # requests in one iteration; also the number of slots
    max_num_tokens: int = 1024  # tokens per iteration (in-flight strategies)
    max_seq_len: int = 512  # prompt + output per request; the KV cache's length per slot
    capacity_policy: str = "guaranteed-no-evict"
    chunked_prefill: bool = True  # a prompt over the token budget is split across steps (vLLM's engine: always)
    tokens_per_block: int = 16
    kv_blocks: int | None = None  # None: enough for every slot at max_seq_len
    prefix_caching: bool = False  # reuse full KV blocks by content hash across requests
    kv_offload_blocks: int = 0  # the host KV tier's blocks: cached blocks the GPU pool evicts go there (0: none)
    kv_watermark: float = 0.0  # max-utilization: free-block fraction kept back while requests run (vLLM V1: none)
    cross_kv_blocks: int | None = None  # encoder–decoder: cross-attention KV blocks (None: as many as --kv-blocks)
    pipeline_stages: int = 2  # pipeline strategy: stage processes (--pp), each a contiguous range of layers
    num_micro_batches: int | None = None  # pipeline: micro-batches in flight (None: one per stage)
    stage_timeout_s: float = 60.0  # pipeline: a stage silent this long ends the run
    max_beam_width: int = 1  # beam rows per slot in the decoder state and block tables (TensorRT-LLM's maxBeamWidth)
    device: str = "cpu"
    device_memory: str | None = None  # shared | split; None: shared on CPU and sim, split on CUDA
    device_threads: int = 1  # CPU: torch threads of the device worker (the host keeps the other core)
    # CPU: the device as a process of its own (shares no interpreter lock with the host) or a thread of this one
    cpu_device: str = "process"
    compile: bool = True  # run forward as one TorchScript call (GIL-free on the CPU worker)
    instrument: bool = True  # NVTX ranges (records are always kept)
    sim: SimConfig | None = None  # the simulated device's settings, when device == "sim"
    speculative: SpecConfig | None = None  # speculative decoding (--speculative-config), None: off
    num_replicas: int = 1  # inflight: engines behind a router, each with every limit above (strategies/fleet.py)
    router: str = "least-tokens"  # where a fleet sends an arrival: fewest tokens left to compute, or in turn
    devices: tuple[str, ...] | None = None  # a fleet's engines, one device each (None: every engine on ``device``)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)  # the disagg strategy: workers, staging, link

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 1 <= self.max_beam_width <= self.max_batch_size:
            raise ValueError(f"beam width must be in [1, --max-batch-size={self.max_batch_size}]: a request's "
                             f"beams are rows of one batch, got {self.max_beam_width}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router {self.router!r}: expected one of {', '.join(ROUTERS)}")
        if self.num_replicas <= 0:
            raise ValueError(f"--num-replicas must be positive, got {self.num_replicas}")
        if self.pipeline_stages <= 0 or (self.num_micro_batches is not None and self.num_micro_batches <= 0):
            raise ValueError("--pp and --num-micro-batches must be positive")
        if not self.stage_timeout_s > 0:
            raise ValueError(f"--stage-timeout must be positive, got {self.stage_timeout_s}")
        for name in ("kv_blocks", "cross_kv_blocks"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.kv_offload_blocks < 0:
            raise ValueError(f"--kv-offload-blocks must be >= 0, got {self.kv_offload_blocks}")
        if self.kv_offload_blocks and not self.prefix_caching:
            raise ValueError("--kv-offload-blocks needs --prefix-caching: the host tier keeps cached blocks, "
                             "found again by their hashes")
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"--capacity-policy {self.capacity_policy!r}: expected one of "
                             f"{', '.join(CAPACITY_POLICIES)}")
        if self.max_num_tokens < self.tokens_per_block:
            raise ValueError(f"--max-num-tokens {self.max_num_tokens} is smaller than one KV block "
                             f"({self.tokens_per_block} tokens)")
        if self.device == "sim" and self.sim is None:
            raise ValueError("device 'sim' needs a SimConfig")
        if self.cpu_device not in CPU_DEVICES:
            raise ValueError(f"--cpu-device {self.cpu_device!r}: expected one of {', '.join(CPU_DEVICES)}")
        if self.device_threads < 0:
            raise ValueError("--device-threads must be >= 0 (0: every CPU of the machine)")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"--kv-watermark must be in [0, 1), got {self.kv_watermark}")
        if self.device_memory is not None and self.device_memory not in MEMORY_MODES:
            raise ValueError(f"--device-memory {self.device_memory!r}: expected one of {', '.join(MEMORY_MODES)}")
        if self.device.startswith("cuda") and self.device_memory == "shared":
            raise ValueError("--device-memory shared: a CUDA device always has memory of its own (split)")
        if self.speculative is not None and self.max_beam_width > 1:
            raise ValueError("--speculative-config: beam search does not speculate (vLLM refuses it too)")
        if self.speculative is not None and (self.speculative.acceptance_rate is None) == (self.device == "sim"):
            raise ValueError("--speculative-config: the simulated device's tokens carry no meaning, so it needs "
                             "acceptance_rate" if self.device == "sim" else
                             "--speculative-config acceptance_rate: only the simulated device forces acceptance "
                             "(a real one accepts what the target model agrees with)")
        if self.devices is not None and self.device == "sim":
            raise ValueError("--devices: the simulated device gives each engine GPUs of its own")
        if self.device == "sim" and self.device_memory == "split":
            raise ValueError("--device-memory split: the simulated device keeps no tensors of its own")

    @property
    def memory(self) -> str:
        """The device memory mode in effect."""
        if self.device_memory is not None:
            return self.device_memory
        return "split" if self.device.startswith("cuda") else "shared"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    @property
    def total_kv_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        return self.max_batch_size * self.max_blocks_per_seq

    @property
    def micro_batches(self) -> int:
        return self.num_micro_batches or self.pipeline_stages

    @property
    def total_cross_kv_blocks(self) -> int:
        return self.cross_kv_blocks if self.cross_kv_blocks is not None else self.total_kv_blocks

    def on(self, engine: int) -> ExecutorConfig:
        """This config for a fleet's ``engine``-th engine: on its own device where ``devices`` names one."""
        return replace(self, device=self.devices[engine], devices=None) if self.devices else self

    def to_dict(self) -> dict:
        return asdict(self)
