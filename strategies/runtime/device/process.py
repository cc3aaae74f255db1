"""The CPU as a device process: the engine's device half runs in a process of its own.

A CPU device thread shares the interpreter's lock with the host: every time it comes back from a torch call
while the host runs Python it waits for the lock, which on a 2-vCPU VM costs ~0.1 ms a hand-off, so the
step ran 15–20% longer whenever the host worked beside it (overlap's whole point), and overlap lost to a
stand-in artefact (docs/buffers.md has the measurements). A process shares no lock.

Both processes build the same engine class with the same sizes. The host's copy holds the staging buffers,
in shared memory, and ``meta`` placeholders for device tensors (``buffers/process_memory.py``); the device
process's copy holds the device tensors and reads the same staging buffers. A launch sends the step's
pieces — an engine method's name and its arguments, a buffer set by index with the host ints it carries
(``BufferSet.host_state``) — and returns; replies (piece times in raw ``perf_counter`` seconds, and any
failure) come back in order and are read by ``wait`` or ``query``. One device process serves a host
process's engines one after another (the warm-up's, then the run's, then the next strategy's): it is
started once and reused.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Client
from typing import ClassVar

import torch

from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.buffers.process_memory import HostSideMemory
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.compute import resolve_threads
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.process_server import HOST_WAIT_POLL_S, poll_for
from strategies.runtime.device.stream import DeviceStream, DeviceWork, Piece

START_TIMEOUT_S = 120.0  # imports (torch) on a loaded machine


class DeviceServer:
    """One device process and the connection to it; idle ones are kept for the next engine. Started as
    ``python -m strategies.runtime.device.process_server`` (not multiprocessing's spawn, which would import
    the host's ``__main__`` again), connected over a Unix socket with a key of its own."""

    _idle: ClassVar[list[DeviceServer]] = []

    def __init__(self) -> None:
        key = os.urandom(16)
        folder = tempfile.mkdtemp(prefix="slotbench-device-")
        address = os.path.join(folder, "socket")
        # the process's stderr, open for its life (closed by stop): its last line says why it died, if it does
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        path = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
        self.proc = subprocess.Popen([sys.executable, "-m", "strategies.runtime.device.process_server", address],
                                     env={**os.environ, "SLOTBENCH_DEVICE_KEY": key.hex(), "PYTHONPATH": path},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # it listens once its imports are done
            if self.proc.poll() is not None:
                shutil.rmtree(folder, ignore_errors=True)
                raise RuntimeError(f"the device process exited at start (code {self.proc.returncode}){self._last()}")
            try:
                self.conn = Client(address, family="AF_UNIX", authkey=key)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    self.stop()
                    shutil.rmtree(folder, ignore_errors=True)
                    raise RuntimeError(f"the device process did not start within {START_TIMEOUT_S:g} s") from None
                time.sleep(0.02)
        shutil.rmtree(folder, ignore_errors=True)  # connected: nobody needs the socket's name any more
        self.model_key: int | None = None  # the model the process holds (sent once for warm-up and run)

    def _last(self) -> str:
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return f": {lines[-1][:300]}" if lines else ""

    @classmethod
    def acquire(cls) -> DeviceServer:
        while cls._idle:
            server = cls._idle.pop()
            if server.proc.poll() is None:
                return server
        return cls()

    def release(self) -> None:
        if self.proc.poll() is None:
            DeviceServer._idle.append(self)

    def request(self, msg: tuple) -> tuple:
        """Send ``msg`` and wait for its reply; an error reply raises."""
        self.send(msg)
        reply = self.recv()
        if reply[0] == "error":
            raise rebuild(reply[1], reply[2])
        return reply

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            raise self.gone() from None

    def recv(self) -> tuple:
        try:
            return self.conn.recv()  # blocks without holding the interpreter's lock
        except (EOFError, OSError):
            raise self.gone() from None

    def gone(self) -> RuntimeError:
        """The error that says why the process stopped answering (its exit code and last line)."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return RuntimeError("the device process stopped answering")
        return RuntimeError(f"the device process exited (code {self.proc.returncode}){self._last()}")

    def stop(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.conn.send(("exit",))
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@atexit.register
def _stop_idle_servers() -> None:
    while DeviceServer._idle:
        DeviceServer._idle.pop().stop()


def rebuild(type_name: str, message: str) -> BaseException:
    """The device's exception, raised again on the host: a built-in type as itself, any other as a RuntimeError."""
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{type_name}: {message}")


_MODEL_KEYS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
_NEXT_MODEL_KEY = itertools.count(1)


def model_key(model: torch.nn.Module) -> int:
    """A key for ``model`` that no other model of this process gets, ever. Its ``id`` was the key, and CPython
    reuses an id once its object is freed: a device process that held a freed model took a new one at its
    address for it, and ran the old weights (caught as a TorchScript shape error in a test that ran after
    another in the same worker; with equal shapes it would have been wrong tokens, silently)."""
    key = _MODEL_KEYS.get(model)
    if key is None:
        key = _MODEL_KEYS[model] = next(_NEXT_MODEL_KEY)
    return key


def model_payload(model: torch.nn.Module) -> tuple[bytes, bool]:
    """The model as bytes the device process loads: TorchScript's archive, or a pickle of an eager module."""
    buf = io.BytesIO()
    scripted = isinstance(model, torch.jit.ScriptModule)
    (torch.jit.save if scripted else torch.save)(model, buf)
    return buf.getvalue(), scripted


class ProcessStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, threads: int = 1, split: bool = False) -> None:
        super().__init__(clock, nvtx, HostSideMemory(split))
        self.threads = resolve_threads(threads)
        self._server: DeviceServer | None = None
        self._engine = None
        self._sent: deque[DeviceWork] = deque()  # enqueued, reply not read yet (in order)

    def build_engine(self, cls: type, cfg: object, model: torch.nn.Module, **kwargs: object) -> object:
        engine = cls(cfg, model, self, **kwargs)  # the host's copy: staging buffers, meta tensors
        server = DeviceServer.acquire()
        try:
            key = model_key(model)
            if server.model_key != key:
                payload, scripted = model_payload(model)
                server.request(("model", key, payload, scripted))
                server.model_key = key
            server.request(("build", f"{cls.__module__}:{cls.__qualname__}", cfg, key, kwargs,
                            self.memory.staging, self.threads, self.memory.split, self.nvtx.enabled))
        except BaseException:
            server.stop()
            raise
        finally:
            self.memory.unlink()  # mapped on both sides now (or never to be)
        self._server, self._engine = server, engine
        return engine

    def control(self, msg: tuple) -> None:
        """Send the device process a request outside the step order (``kv_transfer/gloo_link.py``'s "link");
        ``control_reply`` reads its answer. Only between steps: no step's reply may be outstanding."""
        assert self._server is not None and not self._sent, "control requests go between steps"
        self._server.send(msg)

    def control_reply(self) -> None:
        """The answer to ``control``'s request; an error raises."""
        reply = self._server.recv()  # type: ignore[union-attr]
        if reply[0] == "error":
            raise rebuild(reply[1], reply[2])

    def _submit(self, work: DeviceWork, pieces: list[Piece]) -> None:
        states: dict[int, tuple] = {}
        encoded = [(name, self._target(fn), tuple(self._arg(a, states) for a in args)) for name, fn, args in pieces]
        assert self._server is not None, "build_engine first"
        if self.failure is None:
            try:
                self._server.send(("run", work.iteration, encoded, states, self._engine.fault_at_iteration))
            except RuntimeError as exc:  # it died while idle: the failure surfaces at wait, as the stream's
                self.failure = exc  # contract says (a fleet's fault handling is there, not at launch)
            else:
                self._sent.append(work)
                return
        work.error = self.failure  # the device failed: nothing more runs there
        work.finish()

    def _target(self, fn: Callable[..., None]) -> tuple:
        if getattr(fn, "__self__", None) is self._engine:
            return ("engine", fn.__name__)
        if getattr(fn, "__self__", None) is None and "<" not in fn.__qualname__:
            return ("function", fn.__module__, fn.__qualname__)
        raise ValueError(f"a device process runs engine methods and module-level functions, not {fn!r}")

    @staticmethod
    def _arg(a: object, states: dict[int, tuple]) -> object:
        if isinstance(a, BufferSet):
            states[a.index] = a.host_state()
            return ("bufs", a.index)
        return a

    def _receive(self, server: DeviceServer | None = None) -> None:
        """Read the oldest outstanding reply into its work."""
        work = self._sent.popleft()
        try:
            _, times, error = (server or self._server).recv()  # type: ignore[union-attr]
            at = self.clock.at
            work.times.update({name: (at(s), at(e)) for name, (s, e) in times.items()})
            if error is not None and self.failure is None:
                self.failure = rebuild(*error)
        except RuntimeError as exc:  # the process is gone: every outstanding step fails with that
            self.failure = self.failure or exc
        work.error = self.failure
        work.finish()

    def fault(self) -> BaseException | None:
        """The device process has exited (seen by polling it: no blocking, no message)."""
        server = self._server
        if server is None or server.proc.poll() is None:
            return None
        if self.failure is None:  # (the stream is poisoned: a later step fails at its wait with the same cause)
            self.failure = server.gone()
        return self.failure

    def query(self, work: DeviceWork) -> bool:
        while not work.done() and self._server.conn.poll(0):  # type: ignore[union-attr]
            self._receive()
        return work.done()

    def wait(self, work: DeviceWork) -> float:
        t = time.perf_counter()
        while not work.done():
            poll_for(self._server.conn, HOST_WAIT_POLL_S)  # type: ignore[union-attr]
            self._receive()
        waited = time.perf_counter() - t
        self._raise_failure(work)
        return waited

    def close(self) -> None:
        """Every reply read, the engine dropped over there (its tensors freed), the process kept for the next."""
        server, self._server = self._server, None
        self._engine = None
        if server is None:
            return
        try:
            while self._sent:
                self._receive(server)
            if server.proc.poll() is not None:
                return
            server.request(("close",))
        except (RuntimeError, OSError):
            server.stop()
            return
        server.release()
