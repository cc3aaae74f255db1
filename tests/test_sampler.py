import numpy as np
import pytest
import torch

from strategies.runtime.decoder.sampler import counter_uniform, filter_logits, sample


def params(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0):
    def full(v, dtype):
        return torch.full((b,), v, dtype=dtype)
    return (full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
            full(min_p, torch.float32), full(seed, torch.int64), full(step, torch.int64))


def draw_many(logits_row, n, **kw):
    """n draws for one distribution: the same seed at steps 0..n-1 (independent counter streams)."""
    logits = logits_row.expand(n, -1).contiguous()
    t, k, p, m, s, _ = params(n, **kw)
    steps = torch.arange(n)
    return sample(logits, t, k, p, m, s, steps, True)


def test_temperature_to_zero_equals_greedy():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    greedy = sample(logits, *params(64, temperature=0.0), False)
    assert torch.equal(greedy, logits.argmax(-1))
    cold = sample(logits, *params(64, temperature=1e-4, seed=5, step=3), False)
    assert torch.equal(cold, greedy)


def test_top_k_never_leaves_the_top_k():
    row = torch.randn(50, generator=torch.Generator().manual_seed(2))
    draws = draw_many(row, 4000, top_k=5)
    allowed = set(torch.topk(row, 5).indices.tolist())
    assert set(draws.tolist()) <= allowed
    assert len(set(draws.tolist())) == 5  # and it does use all of them


def test_top_p_respects_the_mass():
    row = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(row, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((cum < 0.7).sum()) + 1].tolist())  # smallest prefix with mass >= 0.7
    draws = set(draw_many(row, 4000, top_p=0.7).tolist())
    assert draws <= nucleus
    assert draws == nucleus


def test_min_p_threshold():
    row = torch.randn(60, generator=torch.Generator().manual_seed(4)) * 2
    probs = torch.softmax(row, -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    draws = set(draw_many(row, 4000, min_p=0.2).tolist())
    assert draws <= allowed
    assert len(allowed) > 1 and draws == allowed


def test_empirical_distribution_matches_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 0.8])
    n = 40000
    draws = draw_many(row, n, temperature=0.9, seed=1234)
    counts = np.bincount(draws.numpy(), minlength=8)
    expected = torch.softmax(row / 0.9, -1).double().numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: the 0.999 quantile is 24.3.
    assert chi2 < 24.3, (chi2, counts, expected)


def test_same_seed_and_step_same_token_whatever_the_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 100, generator=g)
    t, k, p, m, s, st = params(16, temperature=1.0, top_p=0.95)
    s = torch.arange(16) * 7 + 1
    st = torch.arange(16) % 5
    full = sample(logits, t, k, p, m, s, st, True)
    perm = torch.randperm(16, generator=g)
    shuffled = sample(logits[perm], t[perm], k[perm], p[perm], m[perm], s[perm], st[perm], True)
    assert torch.equal(shuffled, full[perm])
    for i in (0, 9):  # alone, in a batch of one
        one = sample(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], m[i:i + 1], s[i:i + 1], st[i:i + 1], True)
        assert one.item() == full[i].item()


def test_noise_is_uniform_and_depends_on_seed_and_step():
    u = counter_uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 10000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(counter_uniform(torch.tensor([1]), torch.tensor([0]), 10000)[0], u[0])


def test_heterogeneous_parameters_in_one_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([0.0, 1.0, 1.0, 1.0])
    k = torch.tensor([0, 1, 0, 0])
    p = torch.tensor([1.0, 1.0, 1e-6, 1.0])
    m = torch.tensor([0.0, 0.0, 0.0, 0.0])
    out = sample(logits, t, k, p, m, torch.arange(4), torch.zeros(4, dtype=torch.long), True)
    top1 = logits.argmax(-1)
    # greedy row, top-k=1 row and a vanishing top-p row are all forced to the argmax
    assert out[0] == top1[0] and out[1] == top1[1] and out[2] == top1[2]


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("top_k", [0, 1, 7, 60])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.6, 0.1])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_filters_keep_exactly_what_hugging_face_keeps(top_k, top_p, min_p):
    """Random logits, every combination: the tokens left with non-zero probability equal those that
    transformers' TopKLogitsWarper → TopPLogitsWarper → MinPLogitsWarper leave."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100) + int(min_p * 10))
    scores = torch.randn(64, 500, generator=g) * torch.linspace(0.3, 4.0, 64).unsqueeze(1)  # flat to peaked rows
    ours = filter_logits(scores, torch.full((64,), top_k), torch.full((64,), top_p), torch.full((64,), min_p))
    ref = scores.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    if min_p:
        ref = MinPLogitsWarper(min_p)(None, ref)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))


def test_step_flags_are_those_of_the_rows_slots():
    """The step's two sampler flags (some row filters, some row samples at random), read over the rows'
    slots as 16-bit words, against the rows' own flags in Python; empty, one row and every slot included."""
    from strategies.runtime.buffers.step_io import modes_in_use

    rng = np.random.default_rng(3)
    for case in range(300):
        modes = rng.random((64, 2)) < (0.02, 0.05) if case % 2 else rng.random((64, 2)) < 0.5  # [S, 2] bool
        slots = rng.permutation(64)[:rng.integers(0, 65)] if case > 2 else np.arange(case * 32)[:64]
        expected = (any(bool(modes[s, 0]) for s in slots), any(bool(modes[s, 1]) for s in slots))
        assert modes_in_use(modes, slots) == expected
