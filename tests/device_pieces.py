"""Pieces the stream-contract tests enqueue: module-level functions, so that a device in another process
(``--cpu-device process``) runs them too. Their effects show outside the device: an exception, a file."""

from __future__ import annotations

from pathlib import Path


def fail() -> None:
    raise RuntimeError("boom")


def note(path: str) -> None:
    """Leave a file at ``path``: the piece ran."""
    Path(path).write_text("ran")
