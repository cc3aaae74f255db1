"""Replay loaders, each for a published format, with auto-detection and line-precise errors.

- azure: Azure LLM inference 2023 CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock text with
  7 fractional digits).
- burstgpt: BurstGPT CSV, both layouts (``Timestamp,Model,Request tokens,Response tokens,...`` and the
  later one with ``Session ID`` and ``Elapsed time``); rows with zero response tokens are failed
  requests: skipped and counted.
- mooncake: Mooncake JSONL ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``; each hash id
  stands for one 512-token prefix block, so prompts are built with the trace's prefix sharing.
- slotbench: JSONL ``{"arrival_s", "input_tokens" | "prompt_token_ids", "output_tokens"}`` with optional
  ``request_id`` (unique within the file) and sampling parameters; multi-turn sessions add ``session_id``,
  ``turn`` (0, 1, …) and, on a later turn (which has no ``arrival_s``), ``delay_s``: harness/traces/sessions.py.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from harness.errors import TraceError
from harness.traces.sessions import arrange_sessions
from harness.traces.trace import Trace, TraceRequest

FORMATS = ("azure", "burstgpt", "mooncake", "slotbench")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "stop_token_ids", "beam_width",
                 "length_penalty", "early_stopping", "num_return_sequences")
SESSION_KEYS = ("session_id", "turn", "delay_s")


def load_trace(path: str, fmt: str = "auto") -> Trace:
    p = Path(path)
    if not p.exists():
        raise TraceError(path, None, "no such file")
    if p.is_dir():
        raise TraceError(path, None, "is a directory, not a trace file")
    if fmt != "auto" and fmt not in FORMATS:
        raise TraceError(path, None, f"unknown trace format {fmt!r}; valid: auto, {', '.join(FORMATS)}")
    data = p.read_bytes()
    if not data.strip():
        raise TraceError(path, None, "empty file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(path, None, f"not UTF-8 text ({exc.reason})") from None
    if fmt == "auto":
        fmt = detect_format(path, text)
    rows, skipped = _LOADERS[fmt](path, text)
    if not rows:
        raise TraceError(path, None, "no requests in the file")
    notes: list[str] = []
    arrivals = np.array([r.arrival_s for r in rows])
    if np.any(np.diff(arrivals) < 0):
        order = np.argsort(arrivals, kind="stable")
        rows = [rows[i] for i in order]
        notes.append("timestamps were not sorted; requests were sorted by arrival")
    t0 = rows[0].arrival_s
    rows = [_shift(r, t0) for r in rows]
    return Trace(tuple(rows), source=str(path), format=fmt, sha256=hashlib.sha256(data).hexdigest(),
                 skipped=skipped, notes=tuple(notes))


def detect_format(path: str, text: str) -> str:
    first = text.lstrip().split("\n", 1)[0].strip()
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except json.JSONDecodeError:
            raise TraceError(path, 1, "first line is not valid JSON; cannot detect the format") from None
        if keys & {"input_length", "output_length", "hash_ids"}:
            return "mooncake"
        if keys & {"arrival_s", "input_tokens", "prompt_token_ids"}:
            return "slotbench"
    else:
        # Any one telling column picks the format; the loader then names what is missing.
        header = {h.strip() for h in first.split(",")}
        if header & {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}:
            return "azure"
        if header & {"Request tokens", "Response tokens", "Log Type"}:
            return "burstgpt"
    raise TraceError(path, 1, f"cannot detect the trace format from {first[:80]!r}; "
                              f"pass --trace-format ({', '.join(FORMATS)})")


def _shift(r: TraceRequest, t0: float) -> TraceRequest:
    return replace(r, arrival_s=r.arrival_s - t0)


def _number(path: str, line: int, column: str, value: object, integer: bool) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(path, line, f"{column}: {value!r} is not a number") from None
    if not math.isfinite(x):
        raise TraceError(path, line, f"{column}: {value!r} is not finite")
    if integer and x != int(x):
        raise TraceError(path, line, f"{column}: {value!r} is not an integer")
    return x


def _length(path: str, line: int, column: str, value: object, allow_zero: bool = False) -> int:
    n = int(_number(path, line, column, value, integer=True))
    if n < 0 or (n == 0 and not allow_zero):
        raise TraceError(path, line, f"{column}: {n} is not a positive token count")
    return n


def _csv_rows(path: str, text: str, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    reader.fieldnames = header
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceError(path, 1, f"missing column(s) {', '.join(missing)}; header is {','.join(header)}")
    for i, row in enumerate(reader, start=2):
        if None in row.values() or None in row:
            raise TraceError(path, i, f"expected {len(header)} fields (truncated or malformed row)")
        yield i, row


def _azure_time(path: str, line: int, value: str) -> float:
    try:
        ts = np.datetime64(value.strip().replace(" ", "T"), "ns")
    except ValueError:
        raise TraceError(path, line, f"TIMESTAMP: {value!r} is not a timestamp") from None
    if np.isnat(ts):
        raise TraceError(path, line, f"TIMESTAMP: {value!r} is not a timestamp")
    return ts.astype(np.int64) / 1e9


def _load_azure(path: str, text: str) -> tuple[list[TraceRequest], int]:
    rows = [TraceRequest(_azure_time(path, i, row["TIMESTAMP"]),
                         _length(path, i, "ContextTokens", row["ContextTokens"]),
                         _length(path, i, "GeneratedTokens", row["GeneratedTokens"]))
            for i, row in _csv_rows(path, text, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))]
    return rows, 0


def _load_burstgpt(path: str, text: str) -> tuple[list[TraceRequest], int]:
    rows, skipped = [], 0
    for i, row in _csv_rows(path, text, ("Timestamp", "Request tokens", "Response tokens")):
        t = _number(path, i, "Timestamp", row["Timestamp"], integer=False)
        out = _length(path, i, "Response tokens", row["Response tokens"], allow_zero=True)
        if out == 0:  # BurstGPT marks failed requests with zero response tokens
            skipped += 1
            continue
        rows.append(TraceRequest(t, _length(path, i, "Request tokens", row["Request tokens"]), out))
    return rows, skipped


def _json_lines(path: str, text: str) -> Iterator[tuple[int, dict]]:
    lines = text.split("\n")
    last = max(i for i, s in enumerate(lines) if s.strip())
    for i, s in enumerate(lines, start=1):
        if not s.strip():
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            what = "truncated last line" if i - 1 == last else f"invalid JSON ({exc.msg})"
            raise TraceError(path, i, what) from None
        if not isinstance(obj, dict):
            raise TraceError(path, i, "expected a JSON object")
        yield i, obj


def _require(path: str, line: int, obj: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise TraceError(path, line, f"missing key(s) {', '.join(missing)}")


MOONCAKE_BLOCK = 512  # tokens per hash_ids entry, as published


def _load_mooncake(path: str, text: str) -> tuple[list[TraceRequest], int]:
    rows = []
    for i, obj in _json_lines(path, text):
        _require(path, i, obj, "timestamp", "input_length", "output_length")
        ids = obj.get("hash_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(h, int) and not isinstance(h, bool)
                                                                   and h >= 0 for h in ids)):
            raise TraceError(path, i, "hash_ids: expected a list of non-negative integers")
        rows.append(TraceRequest(_number(path, i, "timestamp", obj["timestamp"], integer=False) / 1e3,
                                 _length(path, i, "input_length", obj["input_length"]),
                                 _length(path, i, "output_length", obj["output_length"]),
                                 prefix_ids=tuple(ids) if ids else None, prefix_block_len=MOONCAKE_BLOCK))
    return rows, 0


def _tokens_or_length(path: str, line: int, obj: dict, ids_key: str,
                      length_key: str) -> tuple[list[int] | None, int | None]:
    """(the token ids, their count) from ``ids_key``, else (None, the count) from ``length_key``, else
    (None, None)."""
    ids = obj.get(ids_key)
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in ids):
            raise TraceError(path, line, f"{ids_key}: expected a non-empty list of non-negative integers")
        return ids, len(ids)
    if length_key in obj:
        return None, _length(path, line, length_key, obj[length_key])
    return None, None


def _load_slotbench(path: str, text: str) -> tuple[list[TraceRequest], int]:
    rows = []
    first_line: dict[str, int] = {}  # request_id → its line: tokens and metrics are kept per request id
    for i, obj in _json_lines(path, text):
        _require(path, i, obj, "output_tokens")
        prompt, n_in = _tokens_or_length(path, i, obj, "prompt_token_ids", "input_tokens")
        if n_in is None:
            raise TraceError(path, i, "missing key input_tokens or prompt_token_ids")
        encoder, n_enc = _tokens_or_length(path, i, obj, "encoder_prompt_token_ids", "encoder_input_tokens")
        unknown = set(obj) - {"arrival_s", "input_tokens", "prompt_token_ids", "output_tokens", "request_id",
                              "encoder_prompt_token_ids", "encoder_input_tokens", *SESSION_KEYS, *SAMPLING_KEYS}
        if unknown:
            raise TraceError(path, i, f"unknown key(s) {', '.join(sorted(unknown))}")
        session_id, turn, delay = _session(path, i, obj)
        if turn == 0:
            _require(path, i, obj, "arrival_s")
        elif "arrival_s" in obj:
            raise TraceError(path, i, f"arrival_s on turn {turn}: a later turn is sent delay_s after the previous "
                                      "turn's last token")
        sampling = {k: obj[k] for k in SAMPLING_KEYS if k in obj} or None
        if sampling:
            _check_sampling(path, i, sampling)
        rid = obj.get("request_id")
        if rid is not None:
            if str(rid) in first_line:
                raise TraceError(path, i, f"request_id {str(rid)!r} repeats line {first_line[str(rid)]}")
            first_line[str(rid)] = i
        arrival = _number(path, i, "arrival_s", obj["arrival_s"], integer=False) if turn == 0 else 0.0
        rows.append((i, TraceRequest(arrival, n_in, _length(path, i, "output_tokens", obj["output_tokens"]),
                                     str(rid) if rid is not None else None,
                                     tuple(prompt) if prompt is not None else None, sampling,
                                     encoder_tokens=n_enc or 0,
                                     encoder_prompt_token_ids=tuple(encoder) if encoder is not None else None,
                                     session_id=session_id, turn=turn, delay_s=delay)))
    return arrange_sessions(path, rows), 0


def _session(path: str, line: int, obj: dict) -> tuple[str | None, int, float]:
    """(session_id, turn, delay_s) of a line; a line outside any session is turn 0 of none."""
    if "session_id" not in obj:
        if "turn" in obj or "delay_s" in obj:
            raise TraceError(path, line, "turn and delay_s need a session_id")
        return None, 0, 0.0
    sid = obj["session_id"]
    if not isinstance(sid, str | int) or isinstance(sid, bool):
        raise TraceError(path, line, f"session_id: {sid!r} is not a string or an integer")
    if "turn" not in obj:
        raise TraceError(path, line, "session_id without turn (0 for the session's first)")
    turn = int(_number(path, line, "turn", obj["turn"], integer=True))
    if turn < 0:
        raise TraceError(path, line, f"turn: {turn} is negative")
    delay = _number(path, line, "delay_s", obj.get("delay_s", 0.0), integer=False)
    if delay < 0:
        raise TraceError(path, line, f"delay_s: {delay} is negative")
    if turn == 0 and "delay_s" in obj:
        raise TraceError(path, line, "delay_s on turn 0: a session's first turn arrives at its arrival_s")
    return str(sid), turn, delay


def _check_sampling(path: str, line: int, sampling: dict) -> None:
    from strategies.runtime.sampling_params import SamplingParams

    values = dict(sampling)
    if "stop_token_ids" in values:
        stops = values["stop_token_ids"]
        if not isinstance(stops, list) or not all(isinstance(t, int) and t >= 0 for t in stops):
            raise TraceError(path, line, "stop_token_ids: expected a list of non-negative integers")
        values["stop_token_ids"] = tuple(stops)
    for key in ("top_k", "seed", "beam_width", "num_return_sequences"):
        if key in values and not (isinstance(values[key], int) and not isinstance(values[key], bool)):
            raise TraceError(path, line, f"{key}: {values[key]!r} is not an integer")
    for key in ("temperature", "top_p", "min_p", "length_penalty"):
        if key in values and not (isinstance(values[key], int | float) and not isinstance(values[key], bool)):
            raise TraceError(path, line, f"{key}: {values[key]!r} is not a number")
    if "ignore_eos" in values and not isinstance(values["ignore_eos"], bool):
        raise TraceError(path, line, f"ignore_eos: {values['ignore_eos']!r} is not true or false")
    if "early_stopping" in values and values["early_stopping"] not in (True, False, "never"):
        raise TraceError(path, line, f"early_stopping: {values['early_stopping']!r} is not true, false or \"never\"")
    if "num_return_sequences" in values and "beam_width" not in values:
        values["beam_width"] = max(1, values["num_return_sequences"])  # checked with the run's width later
    try:
        SamplingParams(**values)
    except ValueError as exc:
        raise TraceError(path, line, str(exc)) from None


_LOADERS: dict[str, Callable[[str, str], tuple[list[TraceRequest], int]]] = {
    "azure": _load_azure, "burstgpt": _load_burstgpt, "mooncake": _load_mooncake, "slotbench": _load_slotbench,
}
