"""Atomic file output: write a temporary file beside the target, then rename it into place."""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
from pathlib import Path

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
    """Strict JSON: NaN and infinities become null, as JSON has neither. ``indent=None`` for large files:
    only then does the json module use its C encoder (a timeline of 10^4 iterations: ~20x faster)."""
    try:  # most objects hold no NaN: encode once, and walk the object only when it does
        text = json.dumps(obj, indent=indent, default=_jsonable, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(obj), indent=indent, default=_jsonable, allow_nan=False)
    atomic_write_text(path, text + "\n")


def _finite(x: object) -> object:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def atomic_write_parquet(path: Path, df: pd.DataFrame) -> None:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    atomic_write_bytes(path, buf.getvalue())


def _jsonable(x: object) -> object:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, tuple | set):
        return list(x)
    return str(x)
