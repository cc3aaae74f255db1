"""The server's life: the engine and front end started, serving until SIGINT or SIGTERM (or an engine fault),
then the unfinished requests ended, the listener closed and the run directory written."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from aiohttp import web

from harness.app import prepare_out
from harness.errors import UserError
from harness.options import RunOptions
from harness.serve.app import FrontEnd
from harness.serve.engine_client import EngineClient
from harness.serve.tokenizer import CheckpointTokenizer, tokenizer_for


def serve(opts: RunOptions, out: Path, host: str, port: int, *, force: bool, model_names: list[str],
          tokenizer_dir: str | None) -> int:
    prepare_out(out, force)
    if tokenizer_dir is not None:  # (before the engine starts: a bad tokenizer costs no model build)
        tokenizer = CheckpointTokenizer(tokenizer_dir)
    engine = EngineClient(opts, out)  # the engine's own process: built, warmed up and serving when this returns
    if tokenizer_dir is None:
        tokenizer = tokenizer_for(None if opts.device == "sim" else opts.model, engine.vocab_size)
    fe = FrontEnd(engine, tokenizer, model_names)
    engine.notify, engine.replied = fe.notify, fe.replied
    return asyncio.run(_serve(fe, engine, host, port, out))


async def _serve(fe: FrontEnd, engine: EngineClient, host: str, port: int, out: Path) -> int:
    loop = asyncio.get_running_loop()
    fe.loop = loop
    runner = web.AppRunner(fe.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        engine.kill()
        raise UserError(f"--host {host} --port {port}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"slotbench serve: {fe.model_name} ({engine.name}) on http://{host}:{port}/v1 — Ctrl-C writes {out}/",
          file=sys.stderr, flush=True)
    while not stop.is_set() and engine.alive:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    fe.closing = True
    error, served = await loop.run_in_executor(None, engine.stop)  # (the engine writes the run directory)
    fe.notify()  # every open stream learns its request's end
    await asyncio.sleep(0.1)  # (their handlers write their last events)
    await runner.cleanup()
    if error:
        print(f"slotbench serve: error: the engine stopped: {error}", file=sys.stderr)
    if engine.stopped is not None:  # (it wrote the run directory before it said so)
        print(f"wrote {out}/ ({served} requests served)", file=sys.stderr)
    return 1 if error else 0
