"""Measured GEMM times by shape: what a device profile fitted to kernel tables keeps of them.

cuBLAS picks a kernel (tile shape, split, schedule) per problem size, and the choice moves a GEMM's time
in steps a roofline cannot follow: on the H100 the 4096 x 22016 up-projection takes 71 us at 128 tokens
and 126 us at 136; at TP 8, 832 to 1,536 tokens all take 45-49 us (one wave of 128 x 256 tiles over the
132 SMs), 1,600 take 76 us.

Where a profile was fitted to tables that measured a GEMM's shape, the simulator prices a token count
at the next count the table measured: the time is a staircase whose steps end at tile boundaries, and
the tables measure every multiple of 8 (16 past 1,024 tokens, 32 past 2,048). Checked on the H100
tables with every other count left out: the counts between are priced within 0.7% (median; 90th
percentile 5.2%) this way, 1.1% (7.1%) by linear interpolation between the neighbours, 5.8% (18%) by the
roofline fitted to every row. Every other shape is priced by the roofline, and so is every count past
the largest measured (scaled to meet the last measurement).

A table maps ``gemm_key(...)`` to ``[tokens, seconds]``: two lists of equal length, tokens strictly
increasing. fp16 and bf16 share a key: tensor cores run both at one rate.
"""

from __future__ import annotations

from bisect import bisect_left

GemmTable = dict[str, list[list[float]]]


def gemm_key(op: str, rows: int, cols: int, tp: int, dtype_bytes: int) -> str:
    """The table key of GEMM ``op``: its (rows x cols) weight before sharding, the TP degree, the dtype's width."""
    return f"{op} {rows}x{cols} tp{tp} {8 * dtype_bytes}-bit"


def validate_table(table: GemmTable) -> None:
    for key, curve in table.items():
        ok = len(curve) == 2 and len(curve[0]) == len(curve[1]) > 0
        if not (ok and all(0 < a < b for a, b in zip(curve[0], curve[0][1:], strict=False)) and curve[0][0] > 0
                and min(curve[1]) > 0):
            raise ValueError(f"device profile: gemm_table[{key!r}] must be [tokens, seconds], tokens increasing, "
                             "both positive")


def measured_at(curve: list[list[float]], tokens: float) -> float | None:
    """Seconds at ``tokens``: what the next measured count up took (cuBLAS tiles the tokens, so a count
    costs what the end of its tile does, and the tables measure the tiles' ends); None past the last
    count, where the caller extrapolates."""
    xs, ys = curve
    i = bisect_left(xs, tokens)
    return ys[i] if i < len(xs) else None
