"""Criteo-format TSV files with a planted signal, for tests, benchmarks and smoke runs.

Each line is exactly a Criteo line (Kaggle ``train.txt`` and 1TB day files share it):
``label \\t 13 integers \\t 26 eight-digit hex ids``, with empty fields for missing values
and small negative values in the second integer column, as in the real data. Labels are
drawn from a fixed logistic teacher over the features, so a model trained on the file
can learn (the teacher's own AUC on the file is returned as ``bayes_auc``)::

    from torchrec_cloud.data.criteo_gen import write_criteo_tsv
    info = write_criteo_tsv("train.txt", rows=20_000, seed=0)
    write_criteo_tsv("day_0.gz", rows=10_000, seed=1)   # gzip when the name ends in .gz
"""

from __future__ import annotations

import gzip
from typing import Optional

import numpy as np

from torchrec_cloud.data.criteo_format import CAT_FEATURES, INT_FEATURES


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def generate(rows: int, seed: int = 0, vocab: int = 200, missing: float = 0.05,
             teacher_seed: int = 1234) -> dict:
    """Columns of a planted Criteo sample: ``labels``, ``dense`` (int64, -1 = missing is
    not used; ``dense_missing`` marks empty fields), ``ids`` (hex ints), ``ids_missing``,
    and ``bayes_auc``. The teacher (ids per feature and their weights) depends only on
    ``teacher_seed``, so files made with different ``seed`` share one signal."""
    teacher = np.random.default_rng(teacher_seed)
    id_values = teacher.integers(0, 2**32, size=(CAT_FEATURES, vocab), dtype=np.int64)
    # A few features carry most of the signal, as in click logs.
    scale = 1.2 * 0.8 ** np.arange(CAT_FEATURES)
    id_weights = teacher.normal(0.0, 1.0, size=(CAT_FEATURES, vocab)) * scale[:, None]
    dense_weights = teacher.normal(0.0, 0.6, size=INT_FEATURES)
    rng = np.random.default_rng(seed)
    # Skewed id popularity, as in click logs.
    p = 1.0 / np.arange(1, vocab + 1) ** 0.8
    p /= p.sum()
    which = rng.choice(vocab, size=(rows, CAT_FEATURES), p=p)
    ids = id_values[np.arange(CAT_FEATURES), which]
    dense = np.floor(rng.exponential(8.0, size=(rows, INT_FEATURES)) ** 1.5).astype(np.int64)
    dense[:, 1] -= rng.integers(0, 4, size=rows) * (rng.random(rows) < 0.1)
    dense_missing = rng.random((rows, INT_FEATURES)) < missing
    ids_missing = rng.random((rows, CAT_FEATURES)) < missing
    logit = (id_weights[np.arange(CAT_FEATURES), which] * ~ids_missing).sum(axis=1)
    logit += (np.log1p(np.maximum(dense, 0)) * ~dense_missing - 1.5) @ dense_weights
    logit -= logit.mean()
    prob = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(rows) < prob).astype(np.int64)
    return {
        "labels": labels,
        "dense": dense,
        "dense_missing": dense_missing,
        "ids": ids,
        "ids_missing": ids_missing,
        "bayes_auc": _auc(prob, labels),
    }


def format_lines(cols: dict) -> list[str]:
    """The TSV lines (without newline) of :func:`generate`'s columns."""
    fields: list[list[str]] = [[str(v) for v in cols["labels"]]]
    for j in range(INT_FEATURES):
        miss = cols["dense_missing"][:, j]
        fields.append(["" if m else str(v) for v, m in zip(cols["dense"][:, j].tolist(), miss)])
    for j in range(CAT_FEATURES):
        miss = cols["ids_missing"][:, j]
        fields.append(["" if m else f"{v:08x}" for v, m in zip(cols["ids"][:, j].tolist(), miss)])
    return ["\t".join(row) for row in zip(*fields)]


def write_criteo_tsv(path: str, rows: int, seed: int = 0, vocab: int = 200,
                     missing: float = 0.05, lines: Optional[list[str]] = None) -> dict:
    """Write a planted Criteo file (gzip if ``path`` ends in ``.gz``); returns the columns
    from :func:`generate` (with ``bayes_auc``). ``lines`` replaces the generated text."""
    cols = generate(rows, seed=seed, vocab=vocab, missing=missing)
    text = "\n".join(lines if lines is not None else format_lines(cols)) + "\n"
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:  # type: ignore[operator]
        f.write(text)
    return cols
