"""Atomic file output: write a temporary file beside the target, then rename it into place."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import orjson
import pandas as pd


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: object, *, indent: int | None = 2) -> None:
    """Strict JSON: NaN and infinities become null, as JSON has neither (orjson's rule). ``indent``: 2 or
    None (one line: a timeline of 10^4 iterations is written ~2x faster than the json module's C encoder)."""
    option = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS | (orjson.OPT_INDENT_2 if indent else 0)
    atomic_write_bytes(path, orjson.dumps(obj, default=_jsonable, option=option) + b"\n")


def atomic_write_parquet(path: Path, df: pd.DataFrame) -> None:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    atomic_write_bytes(path, buf.getvalue())


def _jsonable(x: object) -> object:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, set):
        return list(x)
    return str(x)
