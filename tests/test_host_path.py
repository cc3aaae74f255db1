"""The host's per-iteration phases — schedule, prepare, postprocess — call no torch function: they fill and
read the staging buffers through numpy views. A torch call there costs the dispatcher's overhead every
iteration and, on the CPU device, ran cold after each wait (one ``.tolist()`` of the step's outputs: ~80 us
right after the wait, ~6 us warm, where the numpy view's took ~16 us) — host time the report then showed as
the strategy's. Checked with a torch function mode around each phase, for the strategies whose host loop
is the runtime's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from torch.overrides import TorchFunctionMode

from strategies.base import Strategy
from strategies.config import ExecutorConfig
from strategies.runtime.engine import Engine
from strategies.runtime.sampling_params import SamplingParams
from strategies.runtime.spec.config import SpecConfig
from tests.util import TINY64, assert_accounted, make_requests, run_strategy, tiny_models


class _TorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        self.calls.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))


def _watched(fn: Callable, calls: list[str]) -> Callable:
    def inner(*args: object, **kwargs: object) -> object:
        mode = _TorchCalls()
        with mode:
            out = fn(*args, **kwargs)
        calls.extend(mode.calls)
        return out
    return inner


@pytest.mark.parametrize("strategy,spec", [("inflight", None), ("overlap", None),
                                           ("inflight", SpecConfig(num_speculative_tokens=3))])
def test_host_phases_call_no_torch_function(monkeypatch, strategy, spec):
    calls: list[str] = []
    for cls, name in ((Strategy, "schedule_step"), (Engine, "prepare"), (Strategy, "postprocess")):
        monkeypatch.setattr(cls, name, _watched(getattr(cls, name), calls))
    rng = np.random.default_rng(0)
    specs = [(list(rng.integers(3, TINY64.vocab_size, int(rng.integers(4, 30)))) * 2, 12,
              SamplingParams(temperature=0.8 if i % 2 else 0.0, top_k=20, seed=i)) for i in range(10)]
    requests = make_requests(specs)
    cfg = ExecutorConfig(max_batch_size=4, max_seq_len=96, max_num_tokens=32, tokens_per_block=8,
                         prefix_caching=True, speculative=spec)
    run_strategy(strategy, TINY64, tiny_models()[1], cfg, requests)
    assert_accounted(requests)
    assert sum(len(r.output_token_ids) for r in requests) > 0
    assert not calls, f"torch functions on the host's per-iteration path: {sorted(set(calls))}"
