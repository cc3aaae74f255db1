"""The simulated device's memory (``buffers/sim_memory.py``): the same buffers as on a torch device, in numpy
arrays, so that a simulated run never imports torch (1.3-1.5 s of a 3.5 s run on this machine, issue 27)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from strategies.runtime.buffers.draft_tokens import DraftTokens
from strategies.runtime.buffers.encoder_buffers import EncoderBuffers
from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.buffers.mirrored import Mirrored
from strategies.runtime.buffers.runtime_buffers import RuntimeBuffers
from strategies.runtime.buffers.sim_memory import SimMemory
from strategies.runtime.buffers.step_io import StepIO
from strategies.runtime.kv_transfer.staging import KVStaging
from strategies.runtime.models.config import PRESETS

# Each a whole `slotbench run` on the simulated device: every strategy, speculation with either proposer,
# an encoder–decoder spec with beams, replicas, pipeline stages and disaggregated workers.
RUNS = [
    ["--strategies", "inflight,overlap,static", "--speculative-config",
     '{"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.5}'],
    ["--strategies", "inflight", "--speculative-config",
     '{"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 2, "acceptance_rate": 0.5}'],
    ["--strategies", "inflight,static", "--model-spec", "bart-large", "--encoder-input-len", "32", "--beam-width", "2"],
    ["--strategies", "inflight", "--num-replicas", "2", "--prefix-caching", "--prefix-len", "64"],
    ["--strategies", "pipeline", "--pp", "2"],
    ["--strategies", "disagg", "--num-prefill-workers", "1", "--num-decode-workers", "2"],
]


def test_a_simulated_run_imports_no_torch(tmp_path):
    """Several runs in one process, then which torch modules it holds. (Before buffers/sim_memory.py each of
    these runs imported torch: the buffers were torch tensors, and 32 of the modules a run loads imported it.)"""
    script = f"""
import json, sys
from harness.cli import main
codes = []
for i, args in enumerate({RUNS!r}):
    codes.append(main(["run", "--device", "sim", "--gpu", "h100", "--model-spec", "llama-3-8b", "--num-prompts", "12",
                       "--request-rate", "20", "--no-progress", "--out", {str(tmp_path)!r} + f"/r{{i}}", *args]))
print(json.dumps([codes, sorted(m for m in sys.modules if m.split(".")[0] == "torch")]))
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    codes, torch_modules = json.loads(p.stdout.strip().splitlines()[-1])
    assert codes == [0] * len(RUNS)
    assert all((tmp_path / f"r{i}" / "summary.csv").is_file() for i in range(len(RUNS)))
    assert torch_modules == []


def _mirrored(buffers: object) -> dict[str, Mirrored]:
    return {name: v for name, v in vars(buffers).items() if isinstance(v, Mirrored)}


def _buffers(memory) -> list:
    cfg = PRESETS["tiny"]
    return [RuntimeBuffers(64, 8, 128, 16, cfg.vocab_size, memory, max_drafts=3),
            StepIO(8, 8, memory, np.zeros((4, 2), dtype=bool)), DraftTokens(8, 3, memory),
            EncoderBuffers(64, 8, 128, cfg.hidden_size, cfg.dtype, 16, memory), KVStaging(cfg, 4, 16, memory)]


@pytest.mark.parametrize("split", [False, True])
def test_the_simulated_device_builds_the_buffers_a_torch_device_does(split):
    """Every staging buffer of every buffer kind: the host's numpy view has the same shape and dtype on
    numpy memory as on torch memory (shared and split), and on numpy memory the device's twin is the host
    buffer itself (nothing to copy), as in shared torch memory."""
    import torch

    on_torch, on_sim = _buffers(DeviceMemory(torch.device("cpu"), split=split)), _buffers(SimMemory())
    count = 0
    for t, s in zip(on_torch, on_sim, strict=True):
        mt, ms = _mirrored(t), _mirrored(s)
        assert mt.keys() == ms.keys() and mt
        for name, m in mt.items():
            assert (ms[name].np.shape, ms[name].np.dtype) == (m.np.shape, m.np.dtype), (type(t).__name__, name)
            assert isinstance(ms[name].np, np.ndarray) and ms[name].dev is ms[name].host is ms[name].np
            assert (m.dev is m.host) == (not split)
            count += 1
    assert count >= 15
    # the buffers' device-only tensors: the same shape and dtype whatever the memory
    for name in ("logits",):
        assert tuple(getattr(on_torch[0], name).shape) == getattr(on_sim[0], name).shape
    assert str(on_torch[0].logits.dtype).removeprefix("torch.") == on_sim[0].logits.dtype.name
