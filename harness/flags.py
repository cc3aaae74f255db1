"""``slotbench run``'s flags, derived from ``RunOptions`` (one declaration per option), shared by every command
that takes the run's options (``run``, ``serve``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from harness.options import RunOptions
from harness.options.endpoint import EndpointOptions


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + error)
        print(f"slotbench: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    own = {f.name for f in fields(EndpointOptions)}
    for f in sorted(fields(RunOptions), key=lambda f: f.name in own):  # a server's options after the run's
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_ = meta.pop("help")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{help_} (default: {f.default})")
        elif f.name == "strategies":
            parser.add_argument(flag, default=",".join(f.default), help=help_)
        else:
            kind = str(f.type)
            conv = float if kind.startswith("float") else int if kind.startswith("int") else str
            parser.add_argument(flag, type=conv, default=f.default, help=f"{help_} (default: {f.default})", **meta)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    values = {k: getattr(args, k) for k in RunOptions.option_names()}
    values["strategies"] = tuple(s.strip() for s in values["strategies"].split(",") if s.strip())
    if values["goodput"] is not None:
        values["goodput"] = tuple(values["goodput"])
    return RunOptions(**values)
