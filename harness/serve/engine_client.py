"""The front end's handle on the engine process (``engine_process.py``): it starts it, sends it requests and aborts,
and applies what it publishes between steps to the front end's own copy of each request — its tokens and their
times appended, its end — before telling the front end (``FrontEnd.notify``), as the engine's thread did when both
shared a process."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from collections.abc import Callable
from pathlib import Path

from harness.errors import UserError
from harness.options import RunOptions
from harness.serve.engine_process import engine_main
from strategies.config import ExecutorConfig
from strategies.runtime.request import Request, Status

START_TIMEOUT_S = 600  # building the model and warming it up


class EngineClient:
    def __init__(self, opts: RunOptions, out: Path) -> None:
        self.name = opts.strategies[0]
        self.notify: Callable[[], None] = lambda: None  # the front end's, once it exists
        self.replied: Callable[[Request, str | None], None] = lambda r, reason: None  # accepted (None) or refused
        self.state = (0, 0, 0.0)  # running, waiting, KV usage at the engine's last step
        self.error: str | None = None  # why the engine's loop stopped, if it did
        self.stopped: tuple[str | None, int] | None = None  # (error, requests served) once it wrote the run
        self._requests: dict[str, Request] = {}  # submitted and not ended: the front end's copies
        self._done = threading.Event()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, opts, out), name="slotbench-engine-core",
                                daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.proc.kill()
            raise UserError("the engine process did not start")
        msg = self._receive()
        if msg is None or msg[0] == "failed":
            self.proc.join()
            raise UserError(msg[1] if msg else f"the engine process exited (code {self.proc.exitcode})")
        _, self.opts, self.executor, self.vocab_size = msg
        self.opts: RunOptions
        self.executor: ExecutorConfig
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="slotbench-engine-client", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive() and not self._done.is_set()

    def submit(self, r: Request) -> None:
        """Send ``r`` to the engine; its acceptance comes back through ``replied``."""
        self._requests[r.request_id] = r
        self._send(("submit", r.request_id, r.prompt_token_ids.tolist(), r.max_new_tokens, r.sampling))

    def abort(self, r: Request, reason: str) -> None:
        self._send(("abort", r.request_id, reason))

    def stop(self) -> tuple[str | None, int]:
        """Stop the engine: its requests end, it writes the run directory; (its error, requests served)."""
        self._send(("stop",))
        self._done.wait()
        self.proc.join()
        return self.stopped if self.stopped is not None else (self.error or "the engine process died", 0)

    def _send(self, msg: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # (the engine is gone: the reader says so)
            self._conn.send(msg)

    def _receive(self) -> tuple | None:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _read(self) -> None:
        while (msg := self._receive()) is not None:
            kind = msg[0]
            if kind == "step":
                self._apply(msg[1])
                self.state = msg[2]
                self.notify()
            elif kind in ("accepted", "rejected"):
                r = self._requests.get(msg[1])
                if r is None:
                    continue
                if kind == "accepted":
                    r.arrival_s = msg[2]
                else:
                    del self._requests[msg[1]]
                self.replied(r, None if kind == "accepted" else msg[2])
            elif kind == "died":
                self.error = msg[1]
                self.notify()
            elif kind == "stopped":
                self.stopped = (msg[1], msg[2])
                break
        if self.error is None and self.stopped is None:
            self.proc.join(5)
            self.error = f"the engine process exited (code {self.proc.exitcode})"
        for r in list(self._requests.values()):  # (it died before it could end them)
            if not r.status.terminal:
                r.status, r.finish_reason = Status.FAILED, self.error or "the engine stopped"
        self._requests.clear()
        self._done.set()
        self.notify()

    def kill(self) -> None:
        """Stop the engine process without a run directory (the server could not start listening)."""
        self.proc.kill()
        self.proc.join()

    def _apply(self, updates: list) -> None:
        for rid, tokens, times, status, reason, admitted_s, cached, host_cached, preemptions in updates:
            r = self._requests.get(rid)
            if r is None:
                continue
            for token, t in zip(tokens, times, strict=True):
                r.append_token(token, t)
            r.admitted_s, r.cached_tokens, r.host_cached_tokens, r.preemptions = (admitted_s, cached, host_cached,
                                                                                  preemptions)
            if status is not None:
                r.status, r.finish_reason = Status(status), reason
                del self._requests[rid]
