"""What a server has served, written away as it goes, so that its memory is bounded by what runs, not by what ran.

A served engine hands over, between steps, every ``CHUNK`` finished requests together with the records of the steps
that are done and the slot tenures that have ended (``Executor.take_history``); a writer thread turns them into the
run directory's rows — requests.parquet's, iterations.parquet's, slots.parquet's, tokens.jsonl's lines — and writes
them as numbered part files in a directory of their own. The engine's thread only moves references (a part's
conversion and its write cost milliseconds, which a step must not wait for). At shutdown ``close`` reads the
parts back, once, for the run directory the server writes (``harness/output/strategy_dir.py`` merges them with
what was still held), and removes them.
"""

from __future__ import annotations

import queue
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.output.records import (
    ITERATION_TUPLES,
    REQUEST_DTYPES,
    SLOT_DTYPES,
    iterations_frame,
    requests_frame,
    slots_frame,
    tokens_jsonl,
)
from harness.traces.trace import TraceRequest
from strategies.runtime.buffers.slots import SlotTenure
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.request import Request

CHUNK = 512  # finished requests a part holds: what a server keeps of what it ran, at most, beside what runs


@dataclass
class Spooled:
    """A server's parts, read back: the run directory's rows of what was written away, and its trace's lines."""

    requests: pd.DataFrame
    iterations: pd.DataFrame
    slots: pd.DataFrame
    tokens: bytes  # tokens.jsonl lines
    trace: list[TraceRequest]  # (arrival, prompt, max new tokens) of each request, as run.json's trace counts them
    # parts the writer could not write (a full disk, say), kept as they were handed over, and why
    unwritten: tuple[list[Request], list[IterationRecord], list[SlotTenure]] = field(
        default_factory=lambda: ([], [], []))
    error: str | None = None


class Spool:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parts = 0  # parts handed to the writer
        self.error: BaseException | None = None  # the writer's last failure: its part is kept in memory instead
        self._unwritten: tuple[list, list, list] = ([], [], [])
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="slotbench-spool", daemon=True)
        self._thread.start()

    def put(self, requests: list[Request], records: list[IterationRecord], tenures: list[SlotTenure]) -> None:
        """Write these away (the engine's thread: it only queues them). ``requests`` have ended."""
        self._queue.put((self.parts, requests, records, tenures))
        self.parts += 1

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            part, requests, records, tenures = item
            try:
                rows = requests_frame(requests).assign(max_new_tokens=[r.max_new_tokens for r in requests])
                files = {f"requests-{part:06d}.parquet": rows, f"iterations-{part:06d}.parquet":
                         iterations_frame(records), f"slots-{part:06d}.parquet": slots_frame(tenures)}
                (self.dir / f"tokens-{part:06d}.jsonl").write_bytes(tokens_jsonl(requests))
                for name, frame in files.items():
                    frame.to_parquet(self.dir / name)
            except Exception as exc:  # the part stays in memory, whole (none of its files is read back)
                self.error = exc
                for kind in ("requests", "iterations", "slots", "tokens"):
                    (self.dir / f"{kind}-{part:06d}.{'jsonl' if kind == 'tokens' else 'parquet'}").unlink(
                        missing_ok=True)
                for kept, objects in zip(self._unwritten, (requests, records, tenures), strict=True):
                    kept.extend(objects)

    def close(self) -> Spooled:
        """Every part written, read back, and the directory removed."""
        self._queue.put(None)
        self._thread.join()
        try:
            frames = {kind: [pd.read_parquet(p) for p in sorted(self.dir.glob(f"{kind}-*.parquet"))]
                      for kind in ("requests", "iterations", "slots")}
            tokens = b"".join(p.read_bytes() for p in sorted(self.dir.glob("tokens-*.jsonl")))
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        empty = {"requests": requests_frame([]).assign(max_new_tokens=pd.Series(dtype="int64")),
                 "iterations": iterations_frame([]), "slots": slots_frame([])}
        merged = {k: pd.concat(v, ignore_index=True) if v else empty[k] for k, v in frames.items()}
        # what parquet gives back otherwise than the frames were made: strings as its own type, tuples as arrays
        merged["requests"] = merged["requests"].astype(REQUEST_DTYPES)
        merged["slots"] = merged["slots"].astype(SLOT_DTYPES)
        it = merged["iterations"]
        for c in ITERATION_TUPLES:
            it[c] = [tuple(x) for x in it[c]]
        req = merged["requests"]
        trace = [TraceRequest(a, n, m) for a, n, m in zip(req["arrival_s"].tolist(), req["input_tokens"].tolist(),
                                                           req["max_new_tokens"].tolist(), strict=True)]
        error = f"{type(self.error).__name__}: {self.error}" if self.error is not None else None
        return Spooled(req.drop(columns="max_new_tokens"), merged["iterations"], merged["slots"], tokens, trace,
                       self._unwritten, error)
