"""The runtime's per-slot progress book (strategies/runtime/progress.py).

Two promises. One book at a time: a running request's counters and tokens are in its slot's row and a
request that holds no slot keeps its own. And the book's paths — the scheduler's choice of decode rows and
the postprocess's hand-out of continuing tokens, row by row or as arrays — do exactly what the request-by-
request loops do: the loops are the reference (every strategy ran them before the book existed; the hand-out's
still runs wherever the book's path steps aside — finishes —, and the scheduler's is kept here, ``_plain_decode``),
so each run here is made with the loops alone and again with the book's paths, on the simulated device with
modelled host time (every time in the records is then virtual, so the runs must agree to the last field)."""

from __future__ import annotations

import numpy as np
import pytest

import strategies.runtime.progress as progress
import strategies.scheduler as scheduler
from strategies.config import ExecutorConfig, SimConfig
from strategies.registry import get_strategy
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams
from strategies.runtime.sim.engine import SIM_VOCAB, proxy_config
from strategies.runtime.sim.specs import MODEL_SPECS
from tests.util import ListSource, assert_accounted

MODEL = proxy_config(MODEL_SPECS["llama-3-8b"])
SIM = SimConfig(gpu="h100", model_spec="llama-3-8b", host_time="modelled", host_ms_per_iteration=0.2,
                host_us_per_request=2.0)
CASES = {  # strategy, config, what the case exercises
    "inflight": ("inflight", {}),  # guaranteed-no-evict: blocks taken at admission
    "max-utilization": ("inflight", {"capacity_policy": "max-utilization", "kv_blocks": 300}),  # preemption
    "overlap": ("overlap", {"capacity_policy": "max-utilization", "kv_blocks": 300}),  # rows of a left slot in flight
    "static": ("static", {}),  # finished requests keep their slots until the batch ends
    "prefix-chunked": ("inflight", {"prefix_caching": True, "max_num_tokens": 256}),
    "budget-bound": ("inflight", {"max_num_tokens": 24}),  # short prompts: more decodes than a step's tokens
    # the requests not in flight as the running list, preemption among them
    "pipeline": ("pipeline", {"capacity_policy": "max-utilization", "kv_blocks": 300, "pipeline_stages": 2}),
}

_HAND_OUT = progress.SlotProgress.hand_out
_DECODE_ROWS = scheduler.IterationScheduler._decode_rows
_DECODE_EACH = scheduler.IterationScheduler._decode_each


def _plain_decode(self, batch, running, budget, preempt):
    """The reference for the scheduler's decode rows: the request-by-request loop every strategy ran before the
    book (one token a running request past its prefill with a token still to ask for, in admission order while
    the budget lasts; a new block taken as it goes, preempting where it must)."""
    decodes, prefills = [], []
    for r in running:
        (prefills if r.num_computed_tokens < r.context_target else decodes).append(r)
    tpb = self.kv.tokens_per_block
    for r in decodes:
        if budget < 1:
            break
        if r.slot is None or r.num_output_tokens + r.pending_samples >= r.max_new_tokens:
            continue  # preempted earlier in this loop, or every token it wants is on its way
        position = r.num_computed_tokens
        if position >= self.kv.held_blocks[r.slot] * tpb and not self._allocate(r, position + 1, running, batch,
                                                                                   preempt):
            continue
        batch.gen_requests.append(r)
        batch.gen_positions.append(position)
        r.num_computed_tokens = position + 1
        r.pending_samples += 1
        budget -= 1
    return prefills, budget


def _requests(short: bool) -> list[Request]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, SIM_VOCAB, 64)  # a prefix half of them share (prefix caching)
    out = []
    for i in range(160):
        own = rng.integers(3, SIM_VOCAB, int(rng.integers(2, 6) if short else rng.integers(8, 200)))
        prompt = np.concatenate((shared, own)) if i % 2 and not short else own
        sampling = SamplingParams(seed=i, ignore_eos=i % 3 != 0, stop_token_ids=(5,) if i % 7 == 0 else ())
        out.append(Request(f"r{i}", prompt, int(rng.integers(1, 120)), sampling, arrival_s=i * 0.004))
    return out


def _run(case: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Request], list[dict], dict]:
    """``mode``: "loops" (the reference: every row through the request-by-request loops), "rows" (the book's
    hand-out row by row) or "arrays" (the book's hand-out as arrays on every step); the scheduler's decode rows
    are the book's in both."""
    name, extra = CASES[case]
    monkeypatch.setattr(progress, "MIN_ARRAY_ROWS", 1 if mode == "arrays" else 10**9)
    used = {"hand_out": 0, "decode_rows": 0, "decode_each": 0}
    hand_out, decode_rows, each = _HAND_OUT, _DECODE_ROWS, _DECODE_EACH  # the originals, not an earlier run's spies

    def count_hand_out(self, slots, *args):
        rest = hand_out(self, slots, *args) if mode != "loops" else list(range(len(slots)))
        used["hand_out"] += len(slots) - len(rest)
        return rest

    def count_decode_rows(self, *args):
        used["decode_rows"] += 1
        return (decode_rows if mode != "loops" else _plain_decode)(self, *args)

    def count_each(self, *args):
        used["decode_each"] += 1
        return each(self, *args)

    monkeypatch.setattr(progress.SlotProgress, "hand_out", count_hand_out)
    monkeypatch.setattr(scheduler.IterationScheduler, "_decode_rows", count_decode_rows)
    monkeypatch.setattr(scheduler.IterationScheduler, "_decode_each", count_each)
    cfg = ExecutorConfig(**{"device": "sim", "sim": SIM, "max_batch_size": 48, "max_seq_len": 512,
                            "max_num_tokens": 2048, "tokens_per_block": 16, **extra})
    requests = _requests(case == "budget-bound")
    s = get_strategy(name)(MODEL, None, cfg)
    s.iteration_hook = lambda _: _one_book(s, requests)
    try:
        s.run(ListSource(requests))
    finally:
        s.close()
    assert_accounted(requests)
    _one_book(s, requests)
    return requests, [r.to_dict() for r in s.records], used


def _one_book(s, requests: list[Request]) -> None:
    """Every request that holds a slot is in that slot's row of the strategy's book; no other is anywhere."""
    book = s.progress
    for r in requests:
        if r.slot is None:
            assert not r.in_slot_book and r.book is r.own, r.request_id
        else:
            assert r.book is book and book.holder[r.slot] is r, r.request_id
    held = {r.slot for r in requests if r.slot is not None}
    assert {i for i, h in enumerate(book.holder) if h is not None} == held
    assert all(book.key[r.slot] % 2 == (r.status is Status.RUNNING) for r in requests if r.slot is not None)


@pytest.mark.parametrize("mode", ["rows", "arrays"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_book_paths_do_what_the_loops_do(case, mode, monkeypatch):
    ref, ref_records, ref_used = _run(case, "loops", monkeypatch)
    got, records, used = _run(case, mode, monkeypatch)
    assert ref_used["hand_out"] == ref_used["decode_each"] == 0  # the reference ran the loops alone
    assert used["hand_out"] > 0.8 * sum(r.num_output_tokens for r in got)  # most tokens went through the book
    if case != "static":  # static schedules its own batches; elsewhere most steps commit their rows as arrays
        assert used["decode_each"] < 0.5 * used["decode_rows"]
    if case in ("max-utilization", "overlap", "pipeline"):  # preemption happened: request by request where it must
        assert sum(r.preemptions for r in got) > 0 and used["decode_each"] > 0
    for a, b in zip(ref, got, strict=True):
        assert (a.output_token_ids, a.token_times_s, a.finish_reason, a.preemptions, a.num_computed_tokens) == \
            (b.output_token_ids, b.token_times_s, b.finish_reason, b.preemptions, b.num_computed_tokens), a.request_id
    assert records == ref_records


def test_a_request_takes_its_progress_with_it():
    """Admission moves the request's tokens and counters into the slot's row; leaving moves them back, and the
    row's later tenants do not touch them."""
    book = progress.SlotProgress(2)
    r = Request("a", np.arange(3, 8), 100)
    r.append_token(9, 0.5)
    r.admit(1, 0, book=book)
    assert r.book is book and book.holder[1] is r and book.key[1] == 2 * 1 + 1  # first tenure, running
    assert list(r.token_ids) == [3, 4, 5, 6, 7, 9] and r.token_times_s == [0.5]
    r.num_computed_tokens, r.pending_samples = 6, 2
    r.append_token(11, 0.75)  # received: in flight stays as it was (the caller counts a row read)
    assert book.counters[1].tolist() == [6, 6, 4, 2, 100, 5]  # computed, target, scheduled, outputs, max, prompt
    assert (r.num_output_tokens, r.pending_samples, r.num_scheduled_samples) == (2, 2, 4)
    assert [r.token_times_since(k) for k in range(4)] == [[0.5, 0.75], [0.75], [], []]  # in the book's row
    r.num_output_tokens = 1  # set by hand (a test's set-up): what is in flight stays in flight
    assert (r.num_output_tokens, r.pending_samples) == (1, 2)
    r.num_output_tokens = 2
    r.pending_samples -= 1
    r.leave_slot()
    assert not r.in_slot_book and book.holder[1] is None and book.key[1] == 2
    other = Request("b", np.arange(20, 30), 400)  # wider than the book's rows: they widen
    other.admit(1, 1, book=book)
    other.append_token(1, 1.0)
    assert book.tokens.shape[1] >= 410 and book.key[1] == 2 * 2 + 1
    assert (r.output_token_ids, r.token_times_s) == ([9, 11], [0.5, 0.75])
    assert [r.token_times_since(k) for k in range(4)] == [[0.5, 0.75], [0.75], [], []]  # back on the request
    assert (r.num_computed_tokens, r.pending_samples, r.num_scheduled_samples) == (6, 1, 3)
    assert other.output_token_ids == [1]


@pytest.mark.parametrize("arrays", [True, False])
def test_a_row_of_an_earlier_tenure_is_left_to_the_loop(arrays, monkeypatch):
    """A step's row whose slot another request has taken since (or the same one again), or whose request no
    longer runs, is not handed out in the book: the loop reads it for the request that asked."""
    monkeypatch.setattr(progress, "MIN_ARRAY_ROWS", 1 if arrays else 10**9)
    book = progress.SlotProgress(32)
    reqs = [Request(f"r{i}", np.arange(3, 9), 10) for i in range(20)]
    for i, r in enumerate(reqs):
        r.admit(i, i, book=book)
        r.pending_samples = 1
    keys = book.key[:20] | 1
    reqs[4].leave_slot()
    Request("new", np.arange(3, 9), 10).admit(4, 20, book=book)  # slot 4's next tenant
    out = np.stack([np.arange(20) + 100, np.zeros(20, dtype=np.int64)], axis=1)  # [20, 2] every row continues
    reqs[7].end(Status.FINISHED, "stop")  # static keeps its slot: it no longer runs there
    rest = book.hand_out(np.arange(20), keys, out, 2.0)
    assert rest == [4, 7]
    assert [r.output_token_ids for r in reqs[:8]] == [[100], [101], [102], [103], [], [105], [106], []]
    assert (reqs[0].pending_samples, reqs[7].pending_samples) == (0, 1)
