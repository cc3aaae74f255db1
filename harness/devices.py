"""Which devices a run may use: ``--device`` (every engine's kind) and ``--devices`` (a fleet's engines, one
device each: each replica of ``--num-replicas``, or disagg's prefill workers then its decode workers), checked
against the machine before anything runs."""

from __future__ import annotations

import re
from collections.abc import Sequence

from harness.errors import UserError


def check_device(device: str, strategies: Sequence[str]) -> None:
    if not re.fullmatch(r"cpu|sim|cuda(:\d+)?", device):
        raise UserError(f"--device {device!r}: expected cpu, cuda[:N] or sim")
    if device.startswith("cuda"):
        _gpus(f"--device {device}")
    if "pipeline" in strategies and device.startswith("cuda"):
        raise UserError("pipeline: the stage processes run on the CPU (gloo) or the simulated device here")
    peers = [s for s in strategies if s.startswith("hf-")]
    if peers and device != "cpu":
        raise UserError(f"{peers[0]} runs transformers on the CPU only (--device {device})")


def check_devices(devices: Sequence[str], device: str, engines: dict[str, int]) -> None:
    """``devices``: one per engine of each fleet in the run (``engines``: strategy → its engines), each of
    ``device``'s kind (cpu, or cuda:N with N below the machine's GPU count)."""
    if device == "sim":
        raise UserError("--devices: the simulated device gives each engine GPUs of its own (--tp each)")
    if not engines:
        raise UserError("--devices: only a fleet runs several engines (inflight with --num-replicas, disagg)")
    for name, n in engines.items():
        if n != len(devices):
            raise UserError(f"--devices: {name} runs {n} engines, {len(devices)} devices given: one each")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    bad = [d for d in devices if not re.fullmatch(r"cpu" if kind == "cpu" else r"cuda:\d+", d)]
    if bad:
        raise UserError(f"--devices {bad[0]!r}: expected {'cpu' if kind == 'cpu' else 'cuda:N'} for --device {device}")
    if kind == "cuda":
        have = _gpus("--devices")
        wanted = max(int(d.split(":")[1]) for d in devices) + 1
        if wanted > have:
            raise UserError(f"--devices names cuda:{wanted - 1}: this machine has {have} GPU{'s' * (have != 1)}")


def _gpus(what: str) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{what}: CUDA is not available on this machine")
    return torch.cuda.device_count()
