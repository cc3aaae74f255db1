"""The simulated device's tokens (sim/decoder.py): no sampler runs, so what is checked is what the real decoder
state promises — output lengths, stop ids, EOS unless ignored, discarded rows — and that a request's tokens
depend on its seed alone, whatever strategy or batch it runs in."""

import numpy as np
import pytest

from harness.runner import run_strategy
from strategies.config import ExecutorConfig, SimConfig
from strategies.runtime.request import Request
from strategies.runtime.sampling_params import SamplingParams
from strategies.runtime.sim.engine import SIM_VOCAB, proxy_config
from strategies.runtime.sim.specs import MODEL_SPECS

SPEC = MODEL_SPECS["llama-3-8b"]
CFG = proxy_config(SPEC)
EOS = CFG.eos_token_id


def run(strategy: str, requests: list[Request], max_batch: int = 32, max_beam: int = 1):
    cfg = ExecutorConfig(device="sim", sim=SimConfig(gpu="h100", model_spec="llama-3-8b"), max_batch_size=max_batch,
                         max_seq_len=1024, max_num_tokens=4096, kv_blocks=4096, max_beam_width=max_beam)
    result = run_strategy(strategy, CFG, None, cfg, requests)
    assert result.error is None
    return {r.request_id: r for r in result.requests}


def requests(n: int, out: int, **sampling) -> list[Request]:
    rng = np.random.default_rng(0)
    return [Request(f"r{i}", rng.integers(3, SIM_VOCAB, 16 + i % 5), out, SamplingParams(seed=i, **sampling),
                    arrival_s=i * 0.002) for i in range(n)]


@pytest.mark.parametrize("strategy", ["static", "inflight", "overlap"])
def test_ignore_eos_gives_every_request_its_output_length(strategy):
    done = run(strategy, requests(40, 50, ignore_eos=True))
    assert {(len(r.output_token_ids), r.finish_reason) for r in done.values()} == {(50, "length")}


def test_eos_ends_a_request_at_the_rate_of_one_token_in_the_vocabulary():
    """Tokens are uniform over the vocabulary, so a request of n tokens meets EOS first with probability
    1 - (1 - 1/V)^n; each request ends exactly at its first EOS, or at n without one."""
    n, count = 256, 300
    done = run("inflight", requests(count, n))
    stopped = 0
    for r in done.values():
        tokens = r.output_token_ids
        assert EOS not in tokens[:-1]
        if r.finish_reason == "stop":
            assert tokens[-1] == EOS
            stopped += 1
        else:
            assert (r.finish_reason, len(tokens)) == ("length", n)
    p = 1 - (1 - 1 / SIM_VOCAB) ** n  # 0.394
    sd = (count * p * (1 - p)) ** 0.5
    assert abs(stopped - count * p) <= 4 * sd, (stopped, count * p)


def test_a_requests_own_stop_ids_end_it():
    done = run("inflight", requests(60, 400, ignore_eos=True, stop_token_ids=(7, 11)))
    for r in done.values():
        tokens = r.output_token_ids
        assert not {7, 11} & set(tokens[:-1])
        assert r.finish_reason == ("stop" if tokens[-1] in (7, 11) else "length")
    assert sum(r.finish_reason == "stop" for r in done.values()) > 30  # 1 - (1 - 2/512)^400 = 0.79 of them


def test_stop_ids_end_requests_admitted_after_requests_without_any():
    """The decoder compares only the stop-id columns some admission used: requests with none (ignoring EOS)
    first, then requests with two stop ids, then one with one (its slot's second column stale from the run
    before it would be a stop id it does not have)."""
    first = requests(30, 400, ignore_eos=True)
    later = [Request(f"s{i}", r.prompt_token_ids, 400, SamplingParams(seed=100 + i, ignore_eos=True,
                                                                      stop_token_ids=(7, 11) if i < 30 else (7,)),
                     arrival_s=0.5 + i * 0.002) for i, r in enumerate(requests(40, 400))]
    done = run("inflight", first + later, max_batch=8)
    assert {(len(done[r.request_id].output_token_ids), done[r.request_id].finish_reason) for r in first} == \
        {(400, "length")}
    for r in later:
        tokens, stops = done[r.request_id].output_token_ids, set(r.sampling.stop_token_ids)
        assert not stops & set(tokens[:-1])
        assert done[r.request_id].finish_reason == ("stop" if tokens[-1] in stops else "length")
    assert sum(done[r.request_id].finish_reason == "stop" for r in later) > 20  # 0.79 of those with two


def test_tokens_depend_on_the_seed_alone():
    """The same requests through three strategies and two batch sizes (overlap's extra step, static's padding
    rows, other neighbours): identical tokens, as the counter-based sampler gives on a real device."""
    runs = [run(s, requests(24, 64), max_batch=b) for s in ("static", "inflight", "overlap") for b in (4, 32)]
    for rid in runs[0]:
        assert len({tuple(d[rid].output_token_ids) for d in runs}) == 1, rid
    firsts = {tuple(r.output_token_ids[:8]) for r in runs[0].values()}
    assert len(firsts) == len(runs[0])  # different seeds, different tokens


def test_beam_requests_return_their_sequences():
    done = run("inflight", requests(6, 20, ignore_eos=True, beam_width=3, num_return_sequences=2), max_beam=3)
    for r in done.values():
        assert r.beams is not None and len(r.beams) == 2 and all(len(t) == 20 for t, _ in r.beams)


def _splitmix_token(seed: int, step: int, vocab: int) -> int:
    """The rule sim/decoder.py documents, in Python integers: one splitmix64-style round over (seed, step)."""
    m = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + step) & m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 31
    return x % vocab


def test_each_token_is_the_documented_mix_of_seed_and_step():
    """Checked against the rule computed independently (Python integers, no numpy), through every strategy:
    token k of a request with seed s is mix(s, k); a stop id or EOS ends it there, else its length does."""
    stopped = 0
    for strategy in ("static", "inflight", "overlap"):
        for r in run(strategy, requests(20, 40, stop_token_ids=(5,)), max_batch=8).values():
            seed, tokens = r.sampling.seed, r.output_token_ids
            assert tokens == [_splitmix_token(seed, k, SIM_VOCAB) for k in range(len(tokens))], (strategy, r.request_id)
            end = next((k + 1 for k, t in enumerate(tokens) if t in (5, EOS)), 40)
            assert len(tokens) == end
            assert r.finish_reason == ("stop" if tokens[-1] in (5, EOS) else "length")
            stopped += r.finish_reason == "stop"
    assert stopped >= 3  # 1 - (1 - 2/512)^40 = 0.145 of 60 requests is ~9
