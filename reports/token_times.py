"""Token times as flat arrays: every request's times in one array, and the gaps within each request, from
one ``np.diff`` over all of them instead of an array per request (a 10,000-request run spent ~0.4 s in the
per-request calls). The gaps are the same floats as each request's own ``np.diff``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def flatten(lists: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Every list's times, in order, as one array [N], and each list's count [R]."""
    counts = np.fromiter(map(len, lists), np.int64, len(lists))  # [R]
    return np.fromiter(itertools.chain.from_iterable(lists), np.float64, int(counts.sum())), counts  # [N]


def gaps(flat: np.ndarray, counts: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """The gaps between consecutive times within each list of ``flatten``'s result, in order; ``among``
    [R] bool: only those lists'."""
    if not len(flat):
        return flat
    keep = np.ones(len(flat), bool) if among is None else np.repeat(among, counts)  # [N] by its gap's later end
    keep[(np.cumsum(counts) - counts)[counts > 0]] = False  # a list's first time ends no gap
    return np.diff(flat)[keep[1:]]
