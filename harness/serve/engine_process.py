"""The served engine in a process of its own, as vLLM runs its EngineCore behind its API server: the engine's
loop shares no interpreter lock with the front end's event loop (nor the front end with the engine's spool writer),
so a benchmark through ``serve`` measures the strategy, not the front end's contention (docs/serve.md has the
figures).

The front end's process (``engine_client.py``) and this one speak over a pipe, in order:

- front end → engine: ``("submit", request_id, prompt ids, max new tokens, sampling)``, ``("abort", request_id,
  reason)``, ``("stop",)``;
- engine → front end: ``("ready", options resolved, executor config, vocabulary size)`` or ``("failed", message)``
  once; per submit ``("accepted", request_id, arrival_s)``, ``("rejected", request_id, reason)`` (it can never be
  served: a 400) or ``("refused", request_id, reason)`` (the engine stopped taking requests: a 503); between steps
  ``("step", updates, state)`` — each request's new tokens and times since the last, its end where it ended — and
  the engine's running, waiting and KV usage; ``("died", error)`` if the loop stopped on a fault; and last
  ``("stopped", error, requests served)`` once the run directory is written.

The engine process exits when its pipe closes: a front end killed outright takes it along. It ignores SIGINT and
SIGTERM (a terminal's Ctrl-C reaches the whole process group): the front end tells it to stop, and it writes the
run directory first.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from harness.errors import UserError
from harness.options import RunOptions
from strategies.runtime.progress import OUTPUTS, PROMPT
from strategies.runtime.request import Request

SHUTTING_DOWN = "the server is shutting down"  # the engine's refusal once it stops taking requests


def spool_dir(out: Path) -> Path:
    """Where the engine writes away what has ended (``spool.py``), beside the run directory it will write."""
    return out.with_name(f".{out.name}.spool")


# An update of one request: (request id, new tokens, their times, status value or None while it runs, finish reason,
# admitted_s, cached tokens, of them the host tier's, preemptions)
Update = tuple[str, list[int], list[float], str | None, str | None, float | None, int, int, int]


class Publisher:
    """What changed for each request the engine holds, between steps (the engine's thread), sent by a thread of its
    own — as vLLM's EngineCore hands its outputs to an output thread — so that the engine's loop only reads them: the
    pickling and the write happen while it waits for its next step (a GPU's, or the simulated device's pacing)."""

    def __init__(self, send: Callable[[tuple], None], proxied: bool) -> None:
        self.send = send
        self.proxied = proxied  # disagg: the first token goes out with the decode worker's first (vLLM's proxy)
        self.active: dict[str, tuple[Request, list[int]]] = {}  # request id → (request, [tokens published])
        self.engine = None  # set once the engine exists
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last_state: tuple | None = None
        self._thread = threading.Thread(target=self._send_loop, name="slotbench-engine-output", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        updates: list[Update] = []
        proxied = self.proxied
        for rid, (r, sent) in list(self.active.items()):
            book, row, s = r.book, r.row, sent[0]
            n, terminal = book.counters.item(row, OUTPUTS), r.status.terminal
            if not terminal and (n == s or (n == 1 and proxied)):
                continue
            tokens: list[int] = []
            times: list[float] = []
            if n > s:  # (read from the progress book; an ended beam search's best sequence from the request)
                if terminal:
                    tokens = r.output_tokens[s:n].tolist()
                else:
                    p = book.counters.item(row, PROMPT)
                    tokens = book.tokens[row, p + s:p + n].tolist()
                times = book.times[row, s:n].tolist()[:len(tokens)]
                n = s + len(tokens)
            sent[0] = max(n, s)  # (a preempted beam search starts over: what was streamed stays streamed)
            end = (r.status.value, r.finish_reason) if terminal else (None, None)
            updates.append((rid, tokens, times, *end, r.admitted_s, r.cached_tokens, r.host_cached_tokens,
                            r.preemptions))
            if terminal:
                del self.active[rid]
        engine = self.engine
        state = _state(engine.strategy) if engine is not None else (0, 0, 0.0)
        if updates or state != self._last_state:  # (an idle engine polls ~500 times a second: nothing to say)
            self._last_state = state
            self._queue.put(("step", updates, state))

    def put(self, msg: tuple) -> None:
        """A message after the steps published so far."""
        self._queue.put(msg)

    def close(self) -> None:
        """Every message queued so far sent."""
        self._queue.put(None)
        self._thread.join()

    def _send_loop(self) -> None:
        while (msg := self._queue.get()) is not None:
            self.send(msg)


def _state(executor) -> tuple[int, int, float]:
    workers = list(getattr(executor, "workers", [executor]))
    used, total = sum(w.kv.blocks_in_use for w in workers), sum(w.kv.total_blocks for w in workers)
    return sum(len(w.running) for w in workers), sum(len(w.waiting) for w in workers), used / (total or 1)


def engine_main(conn: Connection, opts: RunOptions, out: Path) -> None:
    """The engine process: build the served engine, serve the front end's commands until ``stop`` (or the pipe
    closes), write the run directory."""
    from harness.serve.engine import ServedEngine, write_served
    from harness.serve.live_source import ServerClosing

    for sig in (signal.SIGINT, signal.SIGTERM):  # (the front end stops it: it writes the run first)
        signal.signal(sig, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            conn.send(msg)

    publisher = Publisher(send, opts.strategies[0] == "disagg")
    try:
        engine = ServedEngine(opts, notify=publisher.notify, spool_dir=spool_dir(out))
    except UserError as exc:
        send(("failed", str(exc)))
        return
    except Exception as exc:  # (a bug, not the user's options: its type and message, one line)
        send(("failed", f"the engine could not start: {type(exc).__name__}: {exc}"))
        return
    publisher.engine = engine
    send(("ready", engine.opts, engine.executor, engine.model_cfg.vocab_size))
    engine.start()
    threading.Thread(target=_watch, args=(engine, publisher), daemon=True, name="slotbench-engine-watch").start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the front end is gone: nobody to serve, nothing to write for
            shutil.rmtree(spool_dir(out), ignore_errors=True)
            os._exit(0)
        if msg[0] == "stop":
            break
        if msg[0] == "abort":
            held = publisher.active.get(msg[1])
            if held is not None:
                engine.source.abort(held[0], msg[2])
            continue
        _, rid, prompt, max_new, sampling = msg
        r = Request(rid, np.asarray(prompt, dtype=np.int64), max_new, sampling)
        reason = engine.strategy.rejection(r)
        with lock:  # (no step's update for it can go out before its acceptance)
            if reason is not None:
                conn.send(("rejected", rid, reason))
                continue
            try:
                engine.submit(r)
            except ServerClosing:  # (the loop stopped on a fault: the front end hears of it next)
                conn.send(("refused", rid, engine.error or SHUTTING_DOWN))
                continue
            publisher.active[rid] = (r, [0])
            conn.send(("accepted", rid, r.arrival_s))
    run = engine.stop()
    publisher.notify()  # every request's end
    served = write_served(out, engine, run)
    publisher.put(("stopped", run.error, served))
    publisher.close()
    conn.close()
    sys.stdout.flush()


def _watch(engine, publisher: Publisher) -> None:
    """Tell the front end at once when the engine's loop stopped on a fault (after its failed requests' ends)."""
    engine.wait()
    if engine.error is not None:
        publisher.put(("died", engine.error))
