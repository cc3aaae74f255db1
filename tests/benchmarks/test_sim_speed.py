"""How fast the simulated device runs: its speed is the harness's own host code per iteration (the real
scheduler, buffers and sampler run; only the forward is a stand-in). Reported as iterations per second
of the strategy loop alone (imports and writing excluded) in ``extra_info``; ``--benchmark-enable`` for
the statistics. Seconds on the clock depend on the machine, so the test command leaves these out:
``python -m pytest -m speed -s tests/benchmarks`` runs them and prints each figure."""

import time

import pytest

from harness.context_length import resolve_max_seq_len
from harness.options import RunOptions
from harness.plan import load_model, make_trace, resolve_executor
from harness.runner import build_requests, run_strategy
from strategies.runtime.sampling_params import SamplingParams

CASES = {
    # ~1,500 iterations at batch <= 8 (a 40-request slice of the 200-request run at 5 req/s)
    "8b-batch-le-8": (RunOptions(device="sim", gpu="h200", model_spec="llama-3-8b", request_rate=5.0, num_prompts=40),
                      1e-3),
    # docs/simulator.md's 70B / TP4 / H200 run, 1,000 of its 10,000 requests: batches of ~100-200
    "70b-tp4": (RunOptions(device="sim", gpu="h200", model_spec="llama-3-70b", tp=4, request_rate=18.0,
                           num_prompts=1000, input_len=512, output_len=256, max_batch_size=256, max_seq_len=2048,
                           max_num_tokens=8192, ignore_eos=True), 4e-3),
}


@pytest.mark.speed
@pytest.mark.parametrize("case", list(CASES))
def test_simulated_iterations_per_second(benchmark, case):
    opts, max_s_per_iteration = CASES[case]
    trace = make_trace(opts)
    model_cfg, model = load_model(opts)
    executor, _ = resolve_executor(resolve_max_seq_len(opts, model_cfg), model_cfg)

    def run():
        reqs = build_requests(list(trace.requests), SamplingParams(ignore_eos=opts.ignore_eos), model_cfg.vocab_size, 0)
        t = time.perf_counter()
        result = run_strategy("inflight", model_cfg, model, executor, reqs)
        return result, time.perf_counter() - t

    result, seconds = benchmark.pedantic(run, rounds=1, iterations=1) if not benchmark.disabled else run()
    if benchmark.disabled:
        benchmark(lambda: None)
    assert result.error is None
    iterations = len(result.records)
    batch = max(r.num_context_requests + r.num_generation_requests for r in result.records)
    benchmark.extra_info.update(iterations=iterations, seconds=seconds, iterations_per_s=iterations / seconds,
                                max_batch=batch)
    print(f"{case}: {iterations} iterations (batch <= {batch}) in {seconds:.2f} s: {iterations / seconds:,.0f} it/s")
    assert seconds / iterations <= max_s_per_iteration
