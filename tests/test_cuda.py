"""CUDA path: streams, events, pinned buffers, non-blocking copies. Skipped without a GPU."""

import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.runtime.engine import script_model
from strategies.runtime.model import build_model
from strategies.runtime.request import SamplingParams
from tests.util import TINY64, make_requests, run_strategy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["static", "inflight", "overlap"])
def test_cuda_tokens_equal_cpu_tokens(name):
    specs = [(list(range(1 + i, 30 + 3 * i)), 20, SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i,
                                                                  ignore_eos=True)) for i in range(12)]
    tokens = {}
    for device in ("cpu", "cuda"):
        model = script_model(build_model(TINY64, device))
        reqs = make_requests(specs)
        s = run_strategy(name, TINY64, model, ExecutorConfig(max_batch_size=6, max_seq_len=128, device=device), reqs)
        tokens[device] = [r.output_token_ids for r in reqs]
        if device == "cuda":
            assert all(r.forward_end_s >= r.forward_start_s for r in s.records)
            assert s.stream.host_buffer((2,), torch.int64).is_pinned()
    assert tokens["cuda"] == tokens["cpu"]
