"""The stored form of preprocessed Criteo data: one fixed-width record per row, and the names
in its ``manifest.json`` (written by :mod:`~torchrec_cloud.data.criteo_preprocess`, read by
:mod:`~torchrec_cloud.data.criteo_reader`; docs/data.md describes both).

A row is one little-endian record: the label, the 13 integers as they were in the TSV
(missing = 0; the reader applies the log transform) and the 26 ids, parsed from hex and
taken modulo the table sizes (int32 when every table has at most 2^31 rows), or raw in
int64 when no sizes were given::

    records = np.frombuffer(shard_bytes, dtype=record_dtype("int32"))
"""

from __future__ import annotations

import numpy as np

INT_FEATURES = 13
CAT_FEATURES = 26
FIELDS = 1 + INT_FEATURES + CAT_FEATURES
DENSE_NAMES = [f"int_{i}" for i in range(INT_FEATURES)]
SPARSE_NAMES = [f"cat_{i}" for i in range(CAT_FEATURES)]
FORMAT_NAME = "torchrec-cloud-criteo-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "_plan.json"
SHARD_DIR = "shards"
INT32_MAX = 2**31 - 1


def record_dtype(sparse_dtype: str) -> np.dtype:
    """One stored row: label, 13 raw integers, 26 ids (int32 or int64), little-endian."""
    return np.dtype(
        [
            ("label", "<i4"),
            ("dense", "<i4", (INT_FEATURES,)),
            ("sparse", "<i8" if sparse_dtype == "int64" else "<i4", (CAT_FEATURES,)),
        ]
    )

