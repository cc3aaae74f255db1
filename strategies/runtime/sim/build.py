"""Assemble the simulated device for a strategy: cost model, virtual-clock stream, stand-in engine."""

from __future__ import annotations

from dataclasses import replace

from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.sim.config import SimConfig, serving_path
from strategies.runtime.sim.cost import CostModel
from strategies.runtime.sim.device import SimPipelineStream, SimStream, VirtualClock
from strategies.runtime.sim.engine import SimEngine
from strategies.runtime.sim.profile import DeviceProfile
from strategies.runtime.sim.specs import resolve_model_spec
from strategies.runtime.spec.config import SpecConfig


def cost_model(sim: SimConfig) -> CostModel:
    profile = DeviceProfile.load(sim.profile) if sim.profile else DeviceProfile.for_gpu(sim.gpu)
    spec = resolve_model_spec(sim.model_spec)
    return CostModel(spec.with_dtype(sim.dtype) if sim.dtype else spec, profile, sim.tp, sim.ep, sim.moe_skew)


def virtual_clock(sim: SimConfig) -> VirtualClock:
    gpu = DeviceProfile.load(sim.profile).gpu.name if sim.profile else sim.gpu
    return VirtualClock(sim.host_time, sim.host_ms_per_iteration / 1e3, sim.host_us_per_request / 1e6,
                        serving_path(sim.serving_path, gpu))


def sim_engine(model_cfg: ModelConfig, sim: SimConfig | None, clock: Clock, nvtx: Nvtx, sizes: dict,
               stages: int = 1, spec: SpecConfig | None = None) -> tuple[SimStream, SimEngine]:
    """``stages`` > 1: the device split into pipeline stages (the pipeline strategy); ``spec``: speculative
    decoding, whose acceptance the simulated device forces."""
    assert sim is not None
    rate = spec.acceptance_rate if spec is not None and spec.acceptance_rate is not None else 0.0
    if not isinstance(clock, VirtualClock):
        raise ValueError("the simulated device needs a VirtualClock (strategies.interface.make_clock)")
    cost = cost_model(sim)
    draft = cost_model(replace(sim, model_spec=spec.model)) if spec is not None and spec.model else None
    p = cost.profile
    stream = (SimPipelineStream(clock, nvtx, stages, p.launch_latency_s, p.sync_latency_s) if stages > 1
              else SimStream(clock, nvtx, p.launch_latency_s, p.sync_latency_s))
    return stream, SimEngine(model_cfg, None, stream, cost=cost, stages=stages, acceptance_rate=rate,
                             draft_cost=draft, **sizes)
