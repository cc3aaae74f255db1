"""One option's declaration: its default and help, and any argparse keywords (``choices``, ``nargs``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **argparse_kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kw})
