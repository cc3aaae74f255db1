"""Every strategy gives the same tokens, and each matches a one-request-at-a-time reference."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strategies.config import ExecutorConfig
from strategies.registry import get_strategy, strategy_names
from strategies.runtime.request import Status
from strategies.runtime.sampling_params import SamplingParams
from tests.util import TINY64, assert_accounted, make_requests, reference_decode, run_strategy, tiny_models

VARIANTS = [  # chunked prefill is on by default; each in-flight strategy is also run without it
    ("static", {}),
    ("inflight", {"chunked_prefill": False}),
    ("inflight", {}),
    ("inflight", {"capacity_policy": "max-utilization", "chunked_prefill": False}),
    ("inflight", {"capacity_policy": "max-utilization"}),
    ("overlap", {"chunked_prefill": False}),
    ("overlap", {"capacity_policy": "max-utilization"}),
]

sampling_st = st.one_of(
    st.just(SamplingParams()),
    st.builds(SamplingParams, temperature=st.sampled_from([0.7, 1.0, 1.5]), top_k=st.sampled_from([0, 5, 50]),
              top_p=st.sampled_from([1.0, 0.9, 0.5]), min_p=st.sampled_from([0.0, 0.05]),
              seed=st.integers(0, 2**32 - 1), ignore_eos=st.booleans()),
)
request_st = st.tuples(st.lists(st.integers(0, 511), min_size=1, max_size=40), st.integers(1, 24), sampling_st)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_st, min_size=1, max_size=10), max_batch=st.integers(1, 6),
       max_num_tokens=st.sampled_from([16, 24, 64]), kv_blocks=st.integers(8, 20))
def test_all_strategies_give_reference_tokens(specs, max_batch, max_num_tokens, kv_blocks):
    eager, scripted = tiny_models()
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    for name, extra in VARIANTS:
        cfg = ExecutorConfig(max_batch_size=max_batch, max_seq_len=72, tokens_per_block=8,
                             max_num_tokens=max_num_tokens, kv_blocks=kv_blocks, **extra)
        reqs = make_requests(specs)
        run_strategy(name, TINY64, scripted, cfg, reqs)
        assert_accounted(reqs)
        for r, exp in zip(reqs, expected, strict=True):
            total = r.prompt_len + r.max_new_tokens
            # static prefills whole rows (one over the budget alone); in-flight chunks, or refuses such a row
            unfit = (total > 72 or -(-total // 8) > kv_blocks
                     or (name != "static" and not cfg.chunked_prefill and r.prompt_len > max_num_tokens))
            assert (r.status is Status.REJECTED) == unfit, (name, extra, r.request_id, r.finish_reason)
            if not unfit:
                assert r.output_token_ids == exp, (name, extra, r.request_id)


def test_preemption_happens_and_changes_no_token():
    eager, scripted = tiny_models()
    specs = [(list(range(1 + i, 20 + i)), 30, SamplingParams(temperature=1.0, seed=i, ignore_eos=True))
             for i in range(8)]
    expected = [reference_decode(eager, TINY64, r) for r in make_requests(specs)]
    for name in ("inflight", "overlap"):
        cfg = ExecutorConfig(max_batch_size=6, max_seq_len=64, tokens_per_block=4, kv_blocks=30,
                             capacity_policy="max-utilization")
        reqs = make_requests(specs)
        s = run_strategy(name, TINY64, scripted, cfg, reqs)
        assert sum(r.preemptions for r in reqs) > 0
        assert sum(rec.preemptions for rec in s.records) == sum(r.preemptions for r in reqs)
        assert [r.output_token_ids for r in reqs] == expected


def test_guaranteed_no_evict_queues_instead_of_preempting():
    _, scripted = tiny_models()
    specs = [(list(range(1, 20)), 30, SamplingParams(ignore_eos=True)) for _ in range(8)]
    cfg = ExecutorConfig(max_batch_size=6, max_seq_len=64, tokens_per_block=4, kv_blocks=30)
    reqs = make_requests(specs)
    s = run_strategy("inflight", TINY64, scripted, cfg, reqs)
    assert all(r.preemptions == 0 and r.num_output_tokens == 30 for r in reqs)
    assert max(rec.kv_blocks_used for rec in s.records) <= 30
    assert max(rec.active_slots for rec in s.records) == 2  # 13 blocks each: two fit in 30


def test_rejections_have_reasons_and_the_run_goes_on():
    _, scripted = tiny_models()
    specs = [([1] * 70, 5, SamplingParams()), ([1, 2, 3], 4, SamplingParams(ignore_eos=True)),
             ([600], 2, SamplingParams()), ([1] * 40, 2, SamplingParams()), ([3, -1], 2, SamplingParams())]
    for name in ("static", "inflight", "overlap"):
        reqs = make_requests(specs)
        run_strategy(name, TINY64, scripted, ExecutorConfig(max_batch_size=2, max_seq_len=64, max_num_tokens=32,
                                                            chunked_prefill=False), reqs)
        assert_accounted(reqs)
        assert reqs[0].status is Status.REJECTED and "max_seq_len" in reqs[0].finish_reason
        assert reqs[1].status is Status.FINISHED and reqs[1].num_output_tokens == 4
        assert reqs[2].status is Status.REJECTED and "vocabulary" in reqs[2].finish_reason
        assert reqs[4].status is Status.REJECTED and "vocabulary" in reqs[4].finish_reason  # a negative id too
        if name == "static":  # a row over the token budget prefills alone, whole
            assert reqs[3].status is Status.FINISHED and reqs[3].num_output_tokens >= 1
        else:
            assert reqs[3].status is Status.REJECTED and "max_num_tokens" in reqs[3].finish_reason


def test_static_pads_and_keeps_finished_rows():
    _, scripted = tiny_models()
    specs = [([1] * 4, 2, SamplingParams(ignore_eos=True)), ([1] * 10, 6, SamplingParams(ignore_eos=True))]
    s = run_strategy("static", TINY64, scripted, ExecutorConfig(max_batch_size=4, max_seq_len=32), make_requests(specs))
    first = s.records[0]
    assert first.num_tokens == 20 and first.num_padding_tokens == 6  # 4 + 6 pads + 10
    assert [r.num_generation_requests for r in s.records[1:]] == [2] * 5  # the short one rides along
    assert sum(r.num_padding_tokens for r in s.records[1:]) == 4


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown strategy 'dynamic'; valid: ") as exc:
        get_strategy("dynamic")
    assert all(name in str(exc.value) for name in strategy_names())
    assert {"static", "inflight", "overlap"} <= set(strategy_names())


@pytest.mark.serial  # compares the device's idle time of two runs: another test's load beside it blurs that
def test_overlap_launches_before_the_previous_step_ends_and_idles_less():
    """From the device's and host's own times: in-flight hands step n+1 to the device only after step n
    ended there (it needs n's tokens); overlap hands most steps over while the previous one still runs."""
    _, scripted = tiny_models()
    specs = [(list(range(1, 30)), 40, SamplingParams(ignore_eos=True)) for _ in range(16)]
    idle = {}
    for name in ("inflight", "overlap"):
        s = run_strategy(name, TINY64, scripted, ExecutorConfig(max_batch_size=8, max_seq_len=128),
                         make_requests(specs))
        pairs = list(itertools.pairwise(s.records))
        early = sum(1 for a, b in pairs if b.launch_s < a.sample_end_s)
        if name == "overlap":
            assert early >= len(pairs) // 2, (early, len(pairs))
            # host work of n+1 happens inside device interval n
            assert sum(1 for a, b in pairs if b.schedule_start_s < a.sample_end_s) >= len(pairs) // 2
        else:
            assert early == 0
        idle[name] = sum(max(0.0, b.forward_start_s - a.sample_end_s) for a, b in pairs)
    assert idle["overlap"] < idle["inflight"]
