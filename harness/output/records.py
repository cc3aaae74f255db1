"""Per-request and per-iteration records as DataFrames, and the token stream as JSON lines.

``requests.parquet`` columns (one row per request; times are run-clock seconds). Two clocks' readings share
that run clock: the client's — ``arrival_s`` (sent, which is when the engine may first see it: the simulated
serving path's leg in is priced with its leg out), ``first_token_s``, ``finish_s`` and ``tokens.jsonl``'s
``times_s`` (received by a streaming client: on ``--device sim`` after the serving path, sim/config.py; elsewhere
when the engine hands them out), ``failed_s``, and the ``*_ms`` latencies derived from them — and the engine's:
``admitted_s``, ``kv_ready_s``, ``kv_transfer_*``, ``prefill_first_token_s``. A request's client times never
decrease (the serving path is a queue), and each is at or after the engine time it follows.
  request_id, arrival_s, input_tokens, output_tokens, status (finished | rejected | failed),
  finish_reason, first_token_s, finish_s, slot (the last slot it held), preemptions, cached_tokens (prompt
  tokens read from the prefix cache instead of computed), host_cached_tokens (of those, the ones the host KV
  tier held: onloaded, not computed), ttft_ms, tpot_ms, e2el_ms (derived, NaN where
  undefined), session_id and turn (multi-turn sessions: <NA> and 0 outside one; a later turn's input_tokens
  count its history, and a turn its session never sent is rejected with the reason, arriving when the
  session ended); admitted_s (its first admission into a slot: where its queueing ended; NaN if never);
  failed_s (when a failure ended a failed request: an engine fault, a dead worker; NaN otherwise);
  kv_ready_s, kv_transfer_start_s, kv_transfer_end_s, kv_transfer_ms, kv_transfer_bytes (the disagg
  strategy: when the prompt's KV was ready to leave the prefill worker (its handoff, engine time), left it and
  landed on the decode worker, and the bytes moved;
  NaN and 0 for a request that never moved); stage (the load stage it was sent in: a workload config's
  stages, in order from 0; 0 without them); prefill_first_token_s, prefill_ttft_ms (disagg: the first token
  as the prefill worker handed it out; ``first_token_s`` and ``ttft_ms`` are when a client behind a proxy gets
  it, with the decode worker's first output, as vLLM's disaggregated proxy streams it; NaN otherwise).
``iterations.parquet``: the fields of ``strategies.runtime.iteration.IterationRecord``.
``slots.parquet`` (one row per slot tenure: a request's hold on a slot from admission to release):
  request_id, slot, width (beams), start_iteration, decode_iteration (first step after the prefill; -1 if it
  never ended), end_iteration (last step that computed it), end (finished | preempted | running | aborted:
  serve's client went away; disagg: handed off | cancelled), worker (fleets: whose slot; "" otherwise): the
  fields of ``strategies.runtime.buffers.slots.SlotTenure``.
``tokens.jsonl``: {"request_id", "tokens": [int], "times_s": [float]} per request. For a beam-search
request ``tokens`` is the best finished sequence; with num_return_sequences > 1 a ``beams`` list holds
each returned sequence as {"tokens", "score"} (score: HF's length-penalised log-probability), best first.
Its ``output_tokens`` and ``times_s`` count decoding steps (one row per beam each), which the best
sequence may be shorter than.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np
import orjson
import pandas as pd

from strategies.runtime.buffers.slots import SlotTenure
from strategies.runtime.iteration import ITERATION_COLUMNS, IterationRecord
from strategies.runtime.request import Request

REQUEST_COLUMNS = ["request_id", "arrival_s", "input_tokens", "output_tokens", "status", "finish_reason",
                   "first_token_s", "finish_s", "slot", "preemptions", "cached_tokens", "host_cached_tokens", "ttft_ms",
                   "tpot_ms", "e2el_ms", "session_id", "turn", "admitted_s", "failed_s", "kv_ready_s",
                   "kv_transfer_start_s", "kv_transfer_end_s", "kv_transfer_ms", "kv_transfer_bytes", "stage",
                   "prefill_first_token_s", "prefill_ttft_ms"]


def requests_frame(requests: list[Request]) -> pd.DataFrame:
    nan = np.nan
    rows = []
    for r in requests:
        first = r.first_token_s if r.first_token_s is not None else nan
        finish = r.finish_s if r.finish_s is not None else nan
        ttft = (first - r.arrival_s) * 1e3
        e2el = (finish - r.arrival_s) * 1e3
        tpot = (e2el - ttft) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else nan
        admitted = r.admitted_s if r.admitted_s is not None else nan
        failed = r.failed_s if r.failed_s is not None else nan
        kv_ready = r.kv_ready_s if r.kv_ready_s is not None else nan
        kv_start = r.kv_transfer_start_s if r.kv_transfer_start_s is not None else nan
        kv_end = r.kv_transfer_end_s if r.kv_transfer_end_s is not None else nan
        prefill_first = r.prefill_first_token_s if r.prefill_first_token_s is not None else nan
        rows.append((r.request_id, r.arrival_s, r.prompt_len, r.num_output_tokens, r.status.value,
                     r.finish_reason or "", first, finish, r.last_slot if r.last_slot is not None else -1,
                     r.preemptions, r.cached_tokens, r.host_cached_tokens, ttft, tpot, e2el, r.session_id, r.turn,
                     admitted, failed, kv_ready, kv_start, kv_end, (kv_end - kv_start) * 1e3, r.kv_transfer_bytes,
                     r.stage, prefill_first, (prefill_first - r.arrival_s) * 1e3))
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS).astype(REQUEST_DTYPES)


# the columns whose type pandas would not infer as the files keep it (an int column of a frame built from tuples, a
# string column): requests_frame's and slots_frame's, and what a frame read back from parquet is cast to again
REQUEST_DTYPES = {"input_tokens": "int64", "output_tokens": "int64", "slot": "int64", "preemptions": "int64",
                  "cached_tokens": "int64", "host_cached_tokens": "int64", "turn": "int64",
                  "kv_transfer_bytes": "int64", "stage": "int64",
                  "session_id": "string", "request_id": "string", "status": "string", "finish_reason": "string"}
SLOT_DTYPES = {"request_id": "string", "end": "string", "worker": "string", "slot": "int64", "width": "int64",
               "start_iteration": "int64", "decode_iteration": "int64", "end_iteration": "int64"}


# IterationRecord's field types: its int and float columns are built as arrays (the rest, strings and tuples, as
# lists); its tuple columns come back from parquet as arrays, and a frame read back turns them into tuples again
_ITERATION_TYPES = {f.name: str(f.type) for f in dataclasses.fields(IterationRecord)}
_ITERATION_ARRAYS = {name: {"int": np.int64, "float": np.float64}.get(t) for name, t in _ITERATION_TYPES.items()}
ITERATION_TUPLES = tuple(name for name, t in _ITERATION_TYPES.items() if t.startswith("tuple"))


def iterations_frame(records: list[IterationRecord]) -> pd.DataFrame:
    # column by column (dataclasses.asdict per record costs ~0.1 ms each: a second per 10^4 iterations), a typed
    # column straight into its array (pandas inferring each column from a list took twice as long: 1.0 s against
    # 0.45 s for 116,543 iterations)
    n, cols = len(records), {}
    for c in ITERATION_COLUMNS:
        get, dtype = operator.attrgetter(c), _ITERATION_ARRAYS[c]
        cols[c] = np.fromiter(map(get, records), dtype, n) if dtype is not None else list(map(get, records))
    return pd.DataFrame(cols, columns=ITERATION_COLUMNS)


SLOT_COLUMNS = ["request_id", "slot", "width", "start_iteration", "decode_iteration", "end_iteration", "end",
                "worker"]


def slots_frame(tenures: list[SlotTenure]) -> pd.DataFrame:
    return pd.DataFrame({c: [getattr(t, c) for t in tenures] for c in SLOT_COLUMNS}, columns=SLOT_COLUMNS).astype(
        SLOT_DTYPES)


def tokens_jsonl(requests: list[Request]) -> bytes:
    # orjson: the json module spent ~1.5 s on the 2.5 million token times of a 10^4-request run (~0.15 s);
    # a request's tokens written from its numpy array, not a list of ints made for it (the same text)
    option = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
    return b"".join(orjson.dumps(_token_line(r), option=option) for r in requests)


def _token_line(r: Request) -> dict:
    line = {"request_id": r.request_id, "tokens": r.output_tokens, "times_s": r.token_times_s}
    if r.beams and len(r.beams) > 1:
        line["beams"] = [{"tokens": tokens, "score": score} for tokens, score in r.beams]
    return line


def read_tokens(text: str) -> dict[str, list[float]]:
    """request_id → token times, from tokens.jsonl."""
    out = {}
    for line in text.splitlines():
        if line.strip():
            obj = orjson.loads(line)
            out[obj["request_id"]] = obj["times_s"]
    return out
