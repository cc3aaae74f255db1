"""Iteration records as a Chrome Trace Event Format file (Perfetto, chrome://tracing).

One process per strategy with two lanes: ``host`` (schedule, prepare, postprocess) and ``device``
(forward, sample, and before them encode in an encoder–decoder model's steps that admit), one complete
("X") slice per phase, tagged with its iteration. Under overlap the host slices of step n+1 sit inside
the device slices of step n; without it they alternate. A pipeline run adds a lane per stage process; a
fleet (disagg, --num-replicas) has a device lane per engine beside its one host lane.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

HOST_PHASES = ("schedule", "prepare", "postprocess")
DEVICE_PHASES = ("draft", "encode", "forward", "sample")
HOST_TID, DEVICE_TID = 1, 2


def chrome_trace(iterations: pd.DataFrame, strategy: str, pid: int = 1) -> dict:
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"slotbench {strategy}"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": HOST_TID, "args": {"name": "host"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": DEVICE_TID, "args": {"name": "device"}},
    ]
    stages = max(map(len, iterations["stage_start_s"]), default=0) if "stage_start_s" in iterations else 0
    for s in range(stages):  # pipeline: a lane per stage process
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": DEVICE_TID + 1 + s,
                       "args": {"name": f"stage {s}"}})
    workers = sorted(set(iterations["worker"]) - {""}) if "worker" in iterations else []
    lanes = {w: DEVICE_TID + 1 + stages + i for i, w in enumerate(workers)}  # a fleet: a device lane per engine
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"device {w}"}}
               for w, tid in lanes.items()]
    # Columns as lists, read by row index: a namedtuple per row and getattr per phase took most of the time
    # (docs/host-path.md). A phase no row ran (draft, encode) is left out whole.
    lanes_of_phases = []  # (phase, category, lane, ts, dur): NaN where the row did not run the phase
    for phases, tid in ((HOST_PHASES, HOST_TID), (DEVICE_PHASES, DEVICE_TID)):
        for phase in phases:
            starts = iterations[f"{phase}_start_s"].to_numpy(float)  # [I]
            ends = iterations[f"{phase}_end_s"].to_numpy(float)  # [I]
            if not np.isnan(starts).all():
                lanes_of_phases.append((phase, "host" if tid == HOST_TID else "device", tid, *_slices(starts, ends)))
    numbers, tokens = iterations["iteration"].tolist(), iterations["num_tokens"].tolist()
    on_worker = iterations["worker"].tolist() if lanes else None
    if stages:  # each step's stage slices (none for a step never waited for), rounded as one array
        first, stage_ts, stage_dur = _stage_slices(iterations)
        micro_batches = iterations["micro_batch"].tolist()
    for i in range(len(numbers)):
        iteration = int(numbers[i])
        if stages:
            for s, j in enumerate(range(first[i], first[i + 1])):
                events.append({"name": f"stage {s}", "cat": "device", "ph": "X", "ts": stage_ts[j],
                               "dur": stage_dur[j], "pid": pid, "tid": DEVICE_TID + 1 + s,
                               "args": {"iteration": iteration, "micro_batch": int(micro_batches[i])}})
        for phase, category, tid, ts, dur in lanes_of_phases:
            start, length = ts[i], dur[i]
            if math.isnan(start) or math.isnan(length):
                continue
            lane = lanes.get(on_worker[i], tid) if tid == DEVICE_TID and lanes else tid
            events.append({"name": phase, "cat": category, "ph": "X", "ts": start, "dur": length,
                           "pid": pid, "tid": lane, "args": {"iteration": iteration, "tokens": int(tokens[i])}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _stage_slices(iterations: pd.DataFrame) -> tuple[list[int], list[float], list[float]]:
    """The pipeline's stage slices of every step, flattened: step i's are ``first[i]:first[i + 1]`` of their
    starts and durations (microseconds)."""
    starts, ends = iterations["stage_start_s"].tolist(), iterations["stage_end_s"].tolist()  # a tuple a step
    first = np.cumsum([0, *map(len, starts)]).tolist()  # [I + 1]
    start = np.array([t for step in starts for t in step], dtype=float)  # [sum of stages]
    end = np.array([t for step in ends for t in step], dtype=float)  # [sum of stages]
    return first, *_slices(start, end)


def _slices(start: np.ndarray, end: np.ndarray) -> tuple[list[float], list[float]]:
    """Slices from ``start`` to ``end`` [I] (seconds) as the trace's ``ts`` and ``dur``, in microseconds: a
    length never negative, NaN where either end is."""
    return microseconds(start), microseconds(np.maximum(end - start, 0.0))


def microseconds(seconds: np.ndarray) -> list[float]:
    """``round(s * 1e6, 3)`` of each of ``seconds`` [I], the doubles Python's ``round`` gives, vectorised:
    ``rint(x * 1000) / 1000`` is the same double wherever the product ``x * 1000`` is further from a half than
    its rounding error (half a spacing of doubles there): the integer is then the same, and the division is
    correctly rounded. Python rounds the few others (all of them past 2^52 / 1000 us, 52 days, where the
    spacing reaches 1). (A ``round`` call per event is slow at 10^5 events: docs/host-path.md.)"""
    x = seconds * 1e6  # [I]
    scaled = x * 1000  # [I]
    out = (np.rint(scaled) / 1000).tolist()
    near = np.abs(scaled - np.floor(scaled) - 0.5) <= np.abs(np.spacing(scaled))  # [I]
    for i in near.nonzero()[0].tolist():
        out[i] = round(float(x[i]), 3)
    return out
