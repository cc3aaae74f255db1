"""User-facing errors: the CLI prints them as one line and exits with status 2, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (a trace file, an option, a suite file). The message is the whole story."""


class TraceError(UserError):
    def __init__(self, path: str, line: int | None, what: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {what}")
