"""Numeric buckets: a dense column's ``transform: bucketize`` (schema.py), its boundaries found
while preprocessing and the bucket of a value, shared by preprocessing and ``predict``::

    summary = Summary()
    summary.add(values)                        # each batch's training values (float64)
    summary.merge(other.values, other.weights) # another input's summary
    b = boundaries(summary.values, summary.weights, buckets=32)
    rows = bucket_rows(x, b)                   # table rows: 0 missing, 1 + #{b <= x}

Boundaries are quantiles of the training rows, computed the way LightGBM bins a feature
(``GreedyFindBin`` in LightGBM's ``src/io/bin.cpp``, v4.x): a column with at most ``buckets``
distinct values gets one bucket per value (boundaries halfway between neighbours); otherwise a
value holding at least ``1 / buckets`` of the rows (the zero of a mostly-zero amount, a common
count) gets a bucket of its own, and the other values share the remaining buckets in equal
numbers of rows. So a column that is 95% zeros still gets about ``buckets - 1`` boundaries
among its non-zero values, where plain quantiles would give one or two.

A :class:`Summary` is the column's distinct values with their counts, kept exact while there
are at most ``2 * SUMMARY_POINTS``; past that, runs of neighbouring values are merged into
``SUMMARY_POINTS`` groups of equal counts (each group at its weighted median), values at
least ``1 / SUMMARY_POINTS`` of the rows staying exact. It is what an input's counts file
holds, so shares merge them in input order (the same boundaries on every share) and a
worker's memory stays bounded whatever the input's size.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SUMMARY_POINTS = 4096


class Summary:
    """Distinct values (sorted) and their counts, compressed past ``2 * points`` values."""

    def __init__(self, points: int = SUMMARY_POINTS) -> None:
        self.points = points
        self.values = np.zeros(0, np.float64)
        self.weights = np.zeros(0, np.int64)

    def add(self, x: np.ndarray) -> None:
        """Count ``x``'s finite values."""
        x = np.asarray(x, np.float64)
        values, counts = np.unique(x[np.isfinite(x)], return_counts=True)
        self.merge(values, counts)

    def merge(self, values: Sequence[float], weights: Sequence[int]) -> None:
        values = np.concatenate((self.values, np.asarray(values, np.float64)))
        weights = np.concatenate((self.weights, np.asarray(weights, np.int64)))
        self.values, inverse = np.unique(values, return_inverse=True)
        self.weights = np.bincount(inverse.reshape(-1), weights=weights, minlength=len(self.values)).round().astype(np.int64)
        if len(self.values) > 2 * self.points:
            self.values, self.weights = _compress(self.values, self.weights, self.points)

    def to_json(self) -> dict:
        return {"values": self.values.tolist(), "weights": self.weights.tolist()}


def _compress(values: np.ndarray, weights: np.ndarray, points: int) -> tuple[np.ndarray, np.ndarray]:
    """About ``points`` groups of neighbouring values, each of about ``total / points`` rows;
    a value of at least that many rows is a group of its own."""
    step = weights.sum() / points
    heavy = weights >= step
    light = np.where(heavy, 0, weights)
    before = np.cumsum(light) - light
    bins = np.floor(before / step).astype(np.int64)
    starts = np.ones(len(values), bool)
    starts[1:] = heavy[1:] | heavy[:-1] | (bins[1:] != bins[:-1])
    group = np.cumsum(starts) - 1
    totals = np.bincount(group, weights=weights).round().astype(np.int64)
    cumulative = np.cumsum(weights)
    first = np.flatnonzero(starts)
    median = np.searchsorted(cumulative, cumulative[first] - weights[first] + totals / 2.0, side="left")
    return values[np.minimum(median, len(values) - 1)], totals


def boundaries(values: np.ndarray, weights: np.ndarray, buckets: int) -> list[float]:
    """At most ``buckets - 1`` increasing boundaries of the distribution ``values`` (sorted,
    distinct) with counts ``weights`` (module docstring: how)."""
    values, weights = np.asarray(values, np.float64), np.asarray(weights, np.int64)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if len(values) <= 1:
        return []
    if len(values) <= buckets:
        return [_between(values[i], values[i + 1]) for i in range(len(values) - 1)]
    total = float(weights.sum())
    heavy = weights >= total / buckets
    rest = max(buckets - int(heavy.sum()), 1)
    step = float(weights[~heavy].sum()) / rest
    while True:
        cuts, acc = [], 0.0
        for i in range(len(values) - 1):
            if heavy[i] or heavy[i + 1]:
                cuts.append(i)
                acc = 0.0
                continue
            acc += weights[i]
            if acc >= step:
                cuts.append(i)
                acc = 0.0
        if len(cuts) <= buckets - 1:
            return [_between(values[i], values[i + 1]) for i in cuts]
        step *= 1.1  # heavy values split the rest into more pieces than planned: wider ones


def _between(lo: float, hi: float) -> float:
    """A boundary between neighbours ``lo < hi``: halfway, or ``hi`` where halfway rounds to ``lo``."""
    mid = lo / 2 + hi / 2
    return float(mid) if lo < mid <= hi else float(hi)


def bucket_rows(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Table rows of values ``x`` (NaN: missing): 0 for a missing value, else 1 + the number
    of boundaries at or below it."""
    rows = np.searchsorted(bounds, x, side="right").astype(np.int64) + 1
    return np.where(np.isnan(x), 0, rows)
