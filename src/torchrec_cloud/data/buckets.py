"""Numeric buckets: a dense column's ``transform: bucketize`` (schema.py), its boundaries found
while preprocessing and the bucket of a value, shared by preprocessing and ``predict``::

    summary = Summary()
    summary.add(values, labels)                # each batch's training values (float64), labels (0/1)
    summary.merge(other.values, other.weights, other.positives)  # another input's summary
    b = label_boundaries(summary.values, summary.weights, summary.positives, buckets=32)
    b = boundaries(summary.values, summary.weights, buckets=32)  # boundaries: quantiles
    rows = bucket_rows(x, b)                   # table rows: 0 missing, 1 + #{b <= x}

``boundaries: label`` (the default) splits where the label changes, as a one-column decision
tree grows; ``boundaries: quantiles`` knows nothing of the label. Both start from quantiles.

Quantile boundaries (:func:`boundaries`) are computed the way LightGBM bins a feature
(``GreedyFindBin`` in LightGBM's ``src/io/bin.cpp``, v4.x): a column with at most ``buckets``
distinct values gets one bucket per value (boundaries halfway between neighbours); otherwise a
value holding at least ``1 / buckets`` of the rows (the zero of a mostly-zero amount, a common
count) gets a bucket of its own, and the other values share the remaining buckets in equal
numbers of rows. So a column that is 95% zeros still gets about ``buckets - 1`` boundaries
among its non-zero values, where plain quantiles would give one or two.

Label boundaries (:func:`label_boundaries`) are where LightGBM's tree learner would split the
column alone (``FeatureHistogram::FindBestThresholdSequentially`` in LightGBM's
``src/treelearner/feature_histogram.hpp``, v4.x, grown best gain first as its leaf-wise
``SerialTreeLearner`` does): the column's training rows in the ``FINE_BINS`` quantile bins
above (LightGBM's ``max_bin``: the thresholds a split may take), each bin's rows and positive
labels read off the summary's points; then, while there are fewer than ``buckets`` buckets,
the split of a bucket that raises the binomial log-likelihood of its labels the most (LightGBM
scores a split by its gradients' second-order gain; with one column and no prior model the
exact likelihood is as cheap), taken if it raises it by at least ``MIN_GAIN`` (a likelihood
ratio of chi-square 20: not noise) with at least ``MIN_ROWS`` rows a side (LightGBM's
``min_data_in_leaf``, as the bench's baseline sets it). Why: a step in the label (an
account younger than 30 days, an amount over 400) falls inside some quantile bucket unless a
boundary happens to sit on it, and a finer quantile grid leaves each bucket's embedding fewer
rows to learn from; the splits put the few boundaries where the label moves and nowhere else
(bench/RESULTS.md, issue #39, measures both against LightGBM). A column whose values do not
move the label gets no boundary: one bucket, beside row 0 for a missing value. Deterministic:
ties go to the first bucket and the lowest threshold.

A :class:`Summary` is the column's distinct values with their counts and their positive
labels, kept exact while there are at most ``2 * SUMMARY_POINTS``; past that, runs of
neighbouring values are merged into ``SUMMARY_POINTS`` groups of equal counts (each group at
its weighted median, holding its members' counts and positives), values at least
``1 / SUMMARY_POINTS`` of the rows staying exact. It is what an input's counts file holds, so
shares merge them in input order (the same boundaries on every share) and a worker's memory
stays bounded whatever the input's size: three arrays of at most ``2 * SUMMARY_POINTS`` plus
one batch's distinct values.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SUMMARY_POINTS = 4096
FINE_BINS = 255
MIN_ROWS = 50
MIN_GAIN = 10.0


class Summary:
    """Distinct values (sorted), their counts and their positive labels, compressed past
    ``2 * points`` values."""

    def __init__(self, points: int = SUMMARY_POINTS) -> None:
        self.points = points
        self.values = np.zeros(0, np.float64)
        self.weights = np.zeros(0, np.int64)
        self.positives = np.zeros(0, np.int64)

    def add(self, x: np.ndarray, labels: np.ndarray) -> None:
        """Count ``x``'s finite values and, beside each, how many of its rows have label 1
        (``labels``: 0/1, one per value of ``x``)."""
        x = np.asarray(x, np.float64)
        finite = np.isfinite(x)
        values, inverse, counts = np.unique(x[finite], return_inverse=True, return_counts=True)
        positives = np.bincount(inverse.reshape(-1), weights=np.asarray(labels)[finite], minlength=len(values))
        self.merge(values, counts, positives.round().astype(np.int64))

    def merge(self, values: Sequence[float], weights: Sequence[int], positives: Sequence[int]) -> None:
        values = np.concatenate((self.values, np.asarray(values, np.float64)))
        weights = np.concatenate((self.weights, np.asarray(weights, np.int64)))
        positives = np.concatenate((self.positives, np.asarray(positives, np.int64)))
        self.values, inverse = np.unique(values, return_inverse=True)
        inverse = inverse.reshape(-1)
        self.weights = _sums(inverse, weights, len(self.values))
        self.positives = _sums(inverse, positives, len(self.values))
        if len(self.values) > 2 * self.points:
            self.values, self.weights, self.positives = _compress(self.values, self.weights, self.positives, self.points)

    def to_json(self) -> dict:
        return {"values": self.values.tolist(), "weights": self.weights.tolist(), "positives": self.positives.tolist()}


def _sums(group: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """Integer sums of ``x`` per ``group`` (exact below 2**53 rows: float64 bincount)."""
    return np.bincount(group, weights=x, minlength=n).round().astype(np.int64)


def _compress(values: np.ndarray, weights: np.ndarray, positives: np.ndarray,
              points: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """About ``points`` groups of neighbouring values, each of about ``total / points`` rows;
    a value of at least that many rows is a group of its own. A group holds its members'
    counts and positives."""
    step = weights.sum() / points
    heavy = weights >= step
    light = np.where(heavy, 0, weights)
    before = np.cumsum(light) - light
    bins = np.floor(before / step).astype(np.int64)
    starts = np.ones(len(values), bool)
    starts[1:] = heavy[1:] | heavy[:-1] | (bins[1:] != bins[:-1])
    group = np.cumsum(starts) - 1
    totals = _sums(group, weights, int(group[-1]) + 1)
    cumulative = np.cumsum(weights)
    first = np.flatnonzero(starts)
    median = np.searchsorted(cumulative, cumulative[first] - weights[first] + totals / 2.0, side="left")
    return values[np.minimum(median, len(values) - 1)], totals, _sums(group, positives, len(totals))


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


def label_boundaries(values: np.ndarray, weights: np.ndarray, positives: np.ndarray, buckets: int,
                     min_rows: int = MIN_ROWS, min_gain: float = MIN_GAIN) -> list[float]:  # fmt: skip
    """At most ``buckets - 1`` increasing boundaries of the summary ``values`` (sorted,
    distinct) with counts ``weights`` and positive labels ``positives``: greedy splits, best
    gain first, among the ``FINE_BINS`` quantile bins' boundaries (module docstring: how, why)."""
    values, weights = np.asarray(values, np.float64), np.asarray(weights, np.int64)
    positives = np.asarray(positives, np.int64)
    fine = np.asarray(boundaries(values, weights, FINE_BINS), np.float64)
    if not len(fine) or buckets < 2:
        return []
    # Bin k holds fine[k-1] <= x < fine[k], as bucket_rows counts; cumulative sums make any
    # run of bins [lo, hi) one subtraction.
    bins = np.searchsorted(fine, values, side="right")
    rows = np.concatenate(([0.0], np.cumsum(np.bincount(bins, weights=weights, minlength=len(fine) + 1))))
    hits = np.concatenate(([0.0], np.cumsum(np.bincount(bins, weights=positives, minlength=len(fine) + 1))))

    def loglik(n: np.ndarray, k: np.ndarray) -> np.ndarray:
        """The binomial log-likelihood of ``k`` positives in ``n`` rows at their own rate."""
        p = np.clip(k / np.maximum(n, 1.0), 1e-12, 1 - 1e-12)
        return k * np.log(p) + (n - k) * np.log1p(-p)

    def best_split(lo: int, hi: int) -> tuple[float, int]:
        """The gain and place ``m`` of the best split of bins ``[lo, hi)`` into ``[lo, m)``,
        ``[m, hi)`` (gain -inf: none with ``min_rows`` a side)."""
        m = np.arange(lo + 1, hi)
        left, right = rows[m] - rows[lo], rows[hi] - rows[m]
        ok = (left >= min_rows) & (right >= min_rows)
        if not ok.any():
            return -np.inf, -1
        whole = loglik(rows[hi] - rows[lo], hits[hi] - hits[lo])
        gain = loglik(left, hits[m] - hits[lo]) + loglik(right, hits[hi] - hits[m]) - whole
        gain = np.where(ok, gain, -np.inf)
        at = int(np.argmax(gain))  # the first of equal gains: the lowest threshold
        return float(gain[at]), int(m[at])

    segments = [(0, len(fine) + 1, *best_split(0, len(fine) + 1))]
    cuts: list[float] = []
    while len(cuts) < buckets - 1 and segments:
        i = max(range(len(segments)), key=lambda j: (segments[j][2], -j))  # the first of equal gains
        lo, hi, gain, m = segments[i]
        if gain < min_gain:
            break
        segments[i:i + 1] = [(lo, m, *best_split(lo, m)), (m, hi, *best_split(m, hi))]
        cuts.append(float(fine[m - 1]))
    return sorted(cuts)


def _between(lo: float, hi: float) -> float:
    """A boundary between neighbours ``lo < hi``: halfway, or ``hi`` where halfway rounds to ``lo``."""
    mid = lo / 2 + hi / 2
    return float(mid) if lo < mid <= hi else float(hi)


def bucket_rows(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Table rows of values ``x`` (NaN: missing): 0 for a missing value, else 1 + the number
    of boundaries at or below it."""
    rows = np.searchsorted(bounds, x, side="right").astype(np.int64) + 1
    return np.where(np.isnan(x), 0, rows)
