"""The front end's handle on the engine process (``engine_process.py``): it starts it, sends it requests and aborts,
and applies what it publishes between steps to the front end's own copy of each request — its tokens and their
times appended, its end — before telling the front end (``FrontEnd.notify``), as the engine's thread did when both
shared a process."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from harness.errors import UserError
from harness.options import RunOptions
from harness.serve.engine_process import SHUTTING_DOWN, engine_main, spool_dir
from strategies.config import ExecutorConfig
from strategies.runtime.request import Request, Status

START_TIMEOUT_S = 600  # building the model and warming it up


class EngineClient:
    def __init__(self, opts: RunOptions, out: Path) -> None:
        self.name = opts.strategies[0]
        self.notify: Callable[[], None] = lambda: None  # the front end's, once it exists
        # the engine's answer to a submit: (request, None, 200) taken; (request, why, 400) it can never be served;
        # (request, why, 503) the engine stopped taking requests
        self.replied: Callable[[Request, str | None, int], None] = lambda r, reason, status: None
        self.state = (0, 0, 0.0)  # running, waiting, KV usage at the engine's last step
        self.error: str | None = None  # why the engine's loop stopped, if it did
        self.stopped: tuple[str | None, int] | None = None  # (error, requests served) once it wrote the run
        self._spool = spool_dir(out)
        self._requests: dict[str, Request] = {}  # submitted and not ended: the front end's copies
        self._lock = threading.Lock()  # ``_requests`` and whether submits still go out (the reader's end, ``stop``)
        self._stopping = False
        self._done = threading.Event()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, opts, out), name="slotbench-engine-core",
                                daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.kill()
            raise UserError("the engine process did not start")
        msg = self._receive()
        if msg is None or msg[0] == "failed":
            self.proc.join()
            raise UserError(msg[1] if msg else f"the engine process exited (code {self.proc.exitcode})")
        _, self.opts, self.executor, self.vocab_size = msg
        self.opts: RunOptions
        self.executor: ExecutorConfig
        self._reader = threading.Thread(target=self._read, name="slotbench-engine-client", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive() and not self._done.is_set()

    def submit(self, r: Request) -> None:
        """Send ``r`` to the engine; its answer comes back through ``replied`` (at once, refused, when the engine is
        gone or stopping)."""
        with self._lock:  # (so that no submit goes out after ``stop``, nor is missed by the reader's end)
            refusal = self.error or (SHUTTING_DOWN if self._stopping or self._done.is_set() else None)
            if refusal is None:
                self._requests[r.request_id] = r
                self._send(("submit", r.request_id, r.prompt_token_ids.tolist(), r.max_new_tokens, r.sampling))
        if refusal is not None:
            self.replied(r, refusal, 503)

    def abort(self, r: Request, reason: str) -> None:
        self._send(("abort", r.request_id, reason))

    def stop(self) -> tuple[str | None, int]:
        """Stop the engine: its requests end, it writes the run directory; (its error, requests served)."""
        with self._lock:
            self._stopping = True
            self._send(("stop",))
        self._done.wait()
        self.proc.join()
        return self.stopped if self.stopped is not None else (self.error or "the engine process died", 0)

    def kill(self) -> None:
        """Stop the engine process without a run directory (the server could not start listening)."""
        self.proc.kill()
        self.proc.join()
        shutil.rmtree(self._spool, ignore_errors=True)

    def _send(self, msg: tuple) -> None:
        with contextlib.suppress(OSError):  # (the engine is gone: the reader says so)
            self._conn.send(msg)

    def _receive(self) -> tuple | None:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _read(self) -> None:
        try:
            while (msg := self._receive()) is not None:
                if self._handle(msg):
                    break
        except Exception as exc:  # (a bug here must not leave the handlers and ``stop`` waiting forever)
            self.error = f"the engine client failed: {type(exc).__name__}: {exc}"
        finally:
            if self.error is None and self.stopped is None:
                self.proc.join(5)
                self.error = f"the engine process exited (code {self.proc.exitcode})"
            if self.stopped is None:
                shutil.rmtree(self._spool, ignore_errors=True)
            with self._lock:
                for r in self._requests.values():  # (it stopped before it could end them)
                    if not r.status.terminal:
                        r.status, r.finish_reason = Status.FAILED, self.error or "the engine stopped"
                self._requests.clear()
                self._done.set()
            self.notify()

    def _handle(self, msg: tuple) -> bool:
        """One message of the engine's; True for its last."""
        kind = msg[0]
        if kind == "step":
            self._apply(msg[1])
            self.state = msg[2]
            self.notify()
        elif kind in ("accepted", "rejected", "refused"):
            with self._lock:
                r = self._requests.get(msg[1]) if kind == "accepted" else self._requests.pop(msg[1], None)
            if r is not None:
                if kind == "accepted":
                    r.arrival_s = msg[2]
                status = {"accepted": 200, "rejected": 400}.get(kind, 503)
                self.replied(r, None if kind == "accepted" else msg[2], status)
        elif kind == "died":
            self.error = msg[1]
            self.notify()
        elif kind == "stopped":
            self.stopped = (msg[1], msg[2])
            return True
        return False

    def _apply(self, updates: list) -> None:
        for rid, tokens, times, status, reason, admitted_s, cached, host_cached, preemptions in updates:
            with self._lock:
                r = self._requests.get(rid) if status is None else self._requests.pop(rid, None)
            if r is None:
                continue
            for token, t in zip(tokens, times, strict=True):
                r.append_token(token, t)
            r.admitted_s, r.cached_tokens, r.host_cached_tokens, r.preemptions = (admitted_s, cached, host_cached,
                                                                                  preemptions)
            if status is not None:
                r.status, r.finish_reason = Status(status), reason
