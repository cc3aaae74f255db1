"""``slotbench serve``: its flags (the run's options, one strategy, where to listen) and the command."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from harness.errors import UserError
from harness.flags import add_run_arguments, options_from_args
from harness.options import RunOptions


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve one strategy over OpenAI-compatible HTTP (completions, chat, metrics); "
                                     "what it served is written as a run directory at shutdown (Ctrl-C)")
    add_run_arguments(p)
    p.add_argument("--strategy", default="inflight", help="the strategy whose loop serves (--strategies is ignored)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the API answers to, the first in responses (as vLLM's); --model as given is always "
                        "one of them (--model-spec on --device sim)")
    p.add_argument("--out", default=None, help="run directory written at shutdown (default: runs/serve-TIME)")
    p.add_argument("--force", action="store_true", help="overwrite an existing run directory")


def cmd_serve(args: argparse.Namespace) -> int:
    from harness.serve.server import serve

    try:
        opts = dataclasses.replace(options_from_args(args), strategies=(args.strategy,))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.strategy.startswith("hf-"):
        raise UserError(f"--strategy {args.strategy}: serve runs slotbench's own strategies (static, inflight, "
                        "overlap, pipeline, disagg)")
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: expected 1-65535")
    out = Path(args.out) if args.out else Path("runs") / time.strftime("serve-%Y%m%d-%H%M%S")
    return serve(opts, out, args.host, args.port, force=args.force, model_names=served_names(opts, args),
                 tokenizer_dir=opts.tokenizer)


def served_names(opts: RunOptions, args: argparse.Namespace) -> list[str]:
    """The names the API answers to: --served-model-name's, then --model as given (vLLM names the model by it, not
    its base name: a client's ``-m DIR`` finds it); --model-spec on --device sim."""
    given = opts.model_spec if opts.device == "sim" else opts.model
    return list(dict.fromkeys([*(args.served_model_name or []), given]))
