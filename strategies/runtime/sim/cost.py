"""A roofline cost model for one forward over the batch actually scheduled.

FLOPs: linear layers 2 × params × tokens (the LM head only for sampled rows) plus attention
4 × layers × hidden × (query, key) pairs. Bytes: the weights once per step, every KV entry attention
reads, and the KV written. Step time = max(FLOPs / (peak × eff_flops), bytes / (bandwidth × eff_bw))
+ a fixed overhead + a per-row cost (or the sum of the two terms, for a device where they do not
overlap). Tensor parallelism divides FLOPs and bytes by ``tp`` and adds two ring all-reduces per
layer. A device profile (efficiencies, overheads) can be fitted to a real run by ``slotbench calibrate``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from strategies.runtime.batch import BatchWork
from strategies.runtime.model_config import ModelConfig
from strategies.runtime.sim.specs import GPUS, GpuSpec

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DeviceProfile:
    gpu: GpuSpec
    eff_flops: float = 0.6  # achieved / peak FLOP/s
    eff_bw: float = 0.8  # achieved / peak bandwidth
    overhead_s: float = 30e-6  # per step: launches, synchronisation
    row_overhead_s: float = 0.0  # per sampled row: what FLOPs and bytes miss (small-batch GEMMs on a CPU)
    allreduce_latency_s: float = 10e-6  # per all-reduce
    launch_latency_s: float = 0.0  # from launch (or the previous step's end) to the device starting
    sync_latency_s: float = 0.0  # from the device finishing to a waiting host seeing it
    # "max": compute and memory traffic overlap (a GPU roofline); "sum": they do not (what calibration
    # finds on a CPU, where small-batch GEMMs lose efficiency a max() cannot express).
    combine: str = "max"
    source: str = "datasheet"  # or the run directory it was calibrated on

    def __post_init__(self) -> None:
        if not (0 < self.eff_flops <= 1.5 and 0 < self.eff_bw <= 1.5) or min(self.overhead_s,
                                                                            self.row_overhead_s) < 0:
            raise ValueError(f"device profile: efficiencies must be in (0, 1.5], overhead >= 0 ({self})")
        if self.combine not in ("max", "sum"):
            raise ValueError(f"device profile: combine must be max or sum, got {self.combine!r}")

    @classmethod
    def for_gpu(cls, name: str) -> DeviceProfile:
        if name not in GPUS:
            raise ValueError(f"--gpu {name!r}: expected one of {', '.join(GPUS)}")
        return cls(GPUS[name])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{**data, "gpu": GpuSpec(**data["gpu"])})
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"--profile {path}: not a device profile ({exc})") from None


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float
    allreduce_s: float


class CostModel:
    def __init__(self, spec: ModelConfig, profile: DeviceProfile, tp: int = 1) -> None:
        if tp <= 0:
            raise ValueError(f"--tp must be positive, got {tp}")
        self.spec, self.profile, self.tp = spec, profile, tp
        self.dtype_bytes = DTYPE_BYTES[spec.dtype]
        h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
        self.linear_params = spec.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * spec.intermediate_size)
        self.head_params = spec.vocab_size * h
        self.weight_bytes = spec.num_parameters * self.dtype_bytes
        self.kv_bytes_per_token = 2 * spec.num_hidden_layers * kv * self.dtype_bytes

    def cost(self, w: BatchWork) -> StepCost:
        s, tp = self.spec, self.tp
        flops = (2 * self.linear_params * w.tokens + 2 * self.head_params * w.samples
                 + 4 * s.num_hidden_layers * s.hidden_size * w.attention_pairs) / tp
        nbytes = (self.weight_bytes + self.kv_bytes_per_token * (w.kv_read_tokens + w.tokens)) / tp
        allreduce = 0.0
        if tp > 1:  # two per layer (attention and MLP outputs), ring: 2(tp-1)/tp of the activations each way
            size = w.tokens * s.hidden_size * self.dtype_bytes
            per = 2 * (tp - 1) / tp * size / self.profile.gpu.link_bw + self.profile.allreduce_latency_s
            allreduce = 2 * s.num_hidden_layers * per
        return StepCost(flops, nbytes, allreduce)

    def step_time(self, w: BatchWork) -> float:
        c, p = self.cost(w), self.profile
        compute = c.flops / (p.gpu.peak_flops * p.eff_flops)
        memory = c.bytes / (p.gpu.mem_bw * p.eff_bw)
        both = max(compute, memory) if p.combine == "max" else compute + memory
        return both + c.allreduce_s + p.overhead_s + p.row_overhead_s * w.samples

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit in the GPUs' memory after the weights (TP shards both)."""
        free = self.tp * self.profile.gpu.mem_bytes * memory_fraction - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))
