"""The server's life: the engine and front end started, serving until SIGINT or SIGTERM (or an engine fault),
then the unfinished requests ended, the listener closed and the run directory written."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from aiohttp import web

from harness.app import prepare_out, staging_dir, write_run
from harness.errors import UserError
from harness.measure import Measured
from harness.options import RunOptions
from harness.plan import Plan
from harness.serve.app import FrontEnd
from harness.serve.engine import ServedEngine
from harness.serve.tokenizer import CheckpointTokenizer, tokenizer_for


def serve(opts: RunOptions, out: Path, host: str, port: int, *, force: bool, model_names: list[str],
          tokenizer_dir: str | None) -> int:
    prepare_out(out, force)
    front: list[FrontEnd] = []  # the engine's thread reaches the front end through it, once both exist
    engine = ServedEngine(opts, notify=lambda: front[0].notify() if front else None)
    if tokenizer_dir is not None:
        tokenizer = CheckpointTokenizer(tokenizer_dir)
    else:
        tokenizer = tokenizer_for(None if opts.device == "sim" else opts.model, engine.model_cfg.vocab_size)
    front.append(FrontEnd(engine, tokenizer, model_names))
    return asyncio.run(_serve(front[0], engine, host, port, out))


async def _serve(fe: FrontEnd, engine: ServedEngine, host: str, port: int, out: Path) -> int:
    loop = asyncio.get_running_loop()
    fe.loop = loop
    runner = web.AppRunner(fe.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        engine.strategy.close()
        raise UserError(f"--host {host} --port {port}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine.start()
    print(f"slotbench serve: {fe.model_name} ({engine.name}) on http://{host}:{port}/v1 — Ctrl-C writes {out}/",
          file=sys.stderr, flush=True)
    while not stop.is_set() and engine.alive:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    fe.closing = True
    run = await loop.run_in_executor(None, engine.stop)
    fe.notify()  # every open stream learns its request's end
    await asyncio.sleep(0.1)  # (their handlers write their last events)
    await runner.cleanup()
    _write(out, engine, run)
    if run.error:
        print(f"slotbench serve: error: the engine stopped: {run.error}", file=sys.stderr)
    served = len(run.requests) + (len(run.spooled.requests) if run.spooled is not None else 0)
    print(f"wrote {out}/ ({served} requests served)", file=sys.stderr)
    return 1 if run.error else 0


def _write(out: Path, engine: ServedEngine, run: object) -> None:
    """The same files as ``slotbench run`` writes, for the one strategy served."""
    opts = engine.run_options()
    plan = Plan(opts, engine.trace(), engine.model_cfg, None, engine.executor, engine.sim_info,
                opts.sampling_defaults(), [])
    staging = staging_dir(out)
    measured = Measured()
    measured.add(staging, run, opts)
    write_run(staging, out, plan, measured, True, lambda msg: print(msg, file=sys.stderr))
