"""Criteo, the built-in schema, as stored: its record, and the Criteo parts of a dataset's
``manifest.json`` (the one format, ``torchrec-cloud-shards``, whose ``schema`` is the built-in
``criteo``: :func:`~torchrec_cloud.data.schema.criteo_schema`), written by
:mod:`~torchrec_cloud.data.preprocess` from Criteo's TSV (:mod:`~torchrec_cloud.data.criteo_tsv`), read by :mod:`~torchrec_cloud.data.reader` (its batches made by :mod:`~torchrec_cloud.data.criteo_reader`)
(docs/data.md describes both), with the checks that need no torch: the manifest
(:func:`load_manifest`; the shards and splits as every dataset's,
:func:`~torchrec_cloud.data.dataset.check_layout`), every shard's size (:func:`check_shards`,
at open) and checksum (:func:`verify_shards`, ``data verify``).

A row is one little-endian record: the label, the 13 integers as they were in the TSV
(missing = 0; the reader applies the log transform) and the 26 ids, parsed from hex and
taken modulo the table sizes (int32 when every table has at most 2^31 rows), or raw in
int64 when no sizes were given::

    records = np.frombuffer(shard_bytes, dtype=record_dtype("int32"))
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from torchrec_cloud import checksum, storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.data.dataset import (  # noqa: F401 (MANIFEST, SHARD_DIR: Criteo's conversion names them from here)
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_SHARDS,
    SHARD_DIR,
    Dataset,
    Shard,
    check_layout,
    check_sizes,
    is_criteo_dataset,
    refuse_old_criteo,
    verify_files,
)
from torchrec_cloud.data.schema import CRITEO_BUILTIN, MAX_TABLE_ROWS, Dense, Label, Schema, Sparse
from torchrec_cloud.untrusted import MAX_INT, MAX_ROWS, Fields, UntrustedInputError, read_json, shown

INT_FEATURES = 13
CAT_FEATURES = 26
FIELDS = 1 + INT_FEATURES + CAT_FEATURES
DENSE_NAMES = [f"int_{i}" for i in range(INT_FEATURES)]
SPARSE_NAMES = [f"cat_{i}" for i in range(CAT_FEATURES)]
PLAN = "_plan.json"
INT32_MAX = 2**31 - 1


def sparse_dtype_for(sizes: Optional[Sequence[int]]) -> str:
    """The narrowest id type that holds ids taken modulo ``sizes`` (none: ids kept whole)."""
    return "int32" if sizes is not None and max(sizes) <= INT32_MAX + 1 else "int64"


def record_dtype(sparse_dtype: str) -> np.dtype:
    """One stored row: label, 13 raw integers, 26 ids (int32 or int64), little-endian."""
    return np.dtype(
        [
            ("label", "<i4"),
            ("dense", "<i4", (INT_FEATURES,)),
            ("sparse", "<i8" if sparse_dtype == "int64" else "<i4", (CAT_FEATURES,)),
        ]
    )


def load_manifest(path: str) -> dict:
    """The manifest of a preprocessed dataset, checked (:func:`check_manifest`), or a
    :class:`ConfigError` saying what to do."""
    url = storage.join(path, MANIFEST)
    try:
        manifest = read_json(url, MAX_MANIFEST_BYTES)
    except storage.StorageNotFoundError as e:
        hint = (
            " (an interrupted preprocessing run: run the same command again to finish it)"
            if _exists(storage.join(path, PLAN))
            else " (make it with: torchrec-cloud data preprocess --format kaggle|terabyte "
            f"--input FILES --output {path})"
        )
        raise ConfigError("dataset_path", f"{url} not found{hint}") from e
    except storage.StorageError as e:
        raise ConfigError("dataset_path", str(e)) from e
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None
    refuse_old_criteo(manifest, path)
    if not is_criteo_dataset(manifest) or manifest.get("version") != FORMAT_VERSION:
        found = manifest if isinstance(manifest, dict) else {}
        schema = found.get("schema")
        name = schema.get("name") if isinstance(schema, dict) else None
        raise ConfigError(
            "dataset_path",
            f"{url} is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest of Criteo, the built-in schema "
            f"(format {shown(found.get('format'))}, version {shown(found.get('version'))}, schema {shown(name)})",
        )
    try:
        return check_manifest(manifest, path)
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None


def check_manifest(manifest: Any, path: str) -> dict:
    """``manifest`` (of the dataset at ``path``) if every field the reader uses has the type and
    range the format allows: the record, the table sizes, the sources, and the shards and
    splits as for every dataset (:func:`~torchrec_cloud.data.dataset.check_layout`: shard paths
    inside the dataset's folder, sizes that agree with the rows, split segments within their
    shard's rows), else an :class:`~torchrec_cloud.untrusted.UntrustedInputError` naming the
    field. The shards' real sizes are checked against these rows when the dataset is opened
    (:func:`check_shards`)."""
    url = storage.join(path, MANIFEST)
    doc = Fields(manifest, url)
    schema = doc.obj("schema")
    schema.text("builtin", choices=(CRITEO_BUILTIN,))
    schema.text("dataset", choices=("kaggle", "terabyte"))
    record = doc.obj("record")
    record.text("byte_order", choices=("little",))
    fields = record.list("fields", 3)
    if len(fields) != 3:
        raise UntrustedInputError(url, "record.fields", f"must list label, dense and sparse, got {len(fields)} fields")
    sparse_dtype = record.at("fields[2]", fields[2]).text("dtype", choices=("int32", "int64"))
    row_bytes = record_dtype(sparse_dtype).itemsize
    record.int("bytes_per_row", lo=row_bytes, hi=row_bytes)
    transforms = doc.obj("transforms")
    transforms.text("dense", choices=("raw",))
    sizes = transforms.ints("table_sizes", CAT_FEATURES, lo=1, hi=MAX_INT, optional=True)
    if sizes is not None and len(sizes) != CAT_FEATURES:
        raise UntrustedInputError(url, transforms.field("table_sizes"), f"needs {CAT_FEATURES} values, got {len(sizes)}")
    for i, source in enumerate(doc.list("sources", MAX_SHARDS)):
        entry = doc.at(f"sources[{i}]", source)
        entry.int("rows", hi=MAX_ROWS)
        entry.int("dense_min", lo=-(2**31), hi=2**31 - 1)
    check_layout(doc, path, row_bytes)
    return manifest


def load_criteo(path: str) -> Dataset:
    """The Criteo dataset at ``path`` as every dataset is described (:class:`~torchrec_cloud.data.dataset.Dataset`,
    what the one reader, :class:`~torchrec_cloud.data.reader.SchemaSource`, reads): its manifest checked
    (:func:`load_manifest`), every shard's size as listed in its folder (:func:`check_shards`). Its
    schema is the built-in one: 13 dense features, 26 id features, no lists; ``table_sizes`` is
    empty when the ids were kept whole (the model's sizes reduce them when read)."""
    manifest = load_manifest(path)
    check_shards(path, manifest)  # a missing or truncated shard stops the run here, named
    sizes = table_sizes(manifest)
    schema = Schema("criteo", Label("label"), tuple(Dense(n, n) for n in DENSE_NAMES),
                    tuple(Sparse(n, n, mapping="modulo", num_embeddings=sizes[i] if sizes else MAX_TABLE_ROWS)
                          for i, n in enumerate(SPARSE_NAMES)))  # fmt: skip
    record = record_dtype(manifest["record"]["fields"][2]["dtype"])
    return Dataset(path, manifest, schema, record, np.dtype("<i4"), list(sizes or []), shards_of(path, manifest),
                   manifest["splits"], {}, {})  # fmt: skip


def table_sizes(manifest: dict) -> Optional[list[int]]:
    """The table sizes a checked manifest's ids were reduced to (None: ids kept whole)."""
    return manifest["transforms"].get("table_sizes")


def _exists(path: str) -> bool:
    try:
        return storage.exists(path)
    except storage.StorageError:
        return False


def shards_of(path: str, manifest: dict) -> list[Shard]:
    """The shards of a checked manifest (:func:`load_manifest`), as every dataset's are described."""
    return [Shard(storage.join(path, *s["path"].split("/")), s["path"], s["rows"], s["bytes"], [], s["source"],
                  s.get(checksum.ALGORITHM)) for s in manifest["shards"]]  # fmt: skip


def check_shards(path: str, manifest: dict) -> None:
    """Raise a :class:`ConfigError` naming the first shard of ``manifest`` that is missing
    under ``path``, is not a regular file inside it, or whose size is not its rows times the
    record size (a copy cut short)."""
    try:
        check_sizes(path, shards_of(path, manifest))
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None


def verify_shards(path: str, manifest: dict, threads: int = 8) -> dict[str, Any]:
    """Every shard's size and, where the manifest records one, checksum (reads every byte;
    shards in parallel): :func:`~torchrec_cloud.data.dataset.verify_files`."""
    return verify_files(path, shards_of(path, manifest), threads)
