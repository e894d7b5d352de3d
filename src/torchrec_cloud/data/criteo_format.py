"""The stored form of preprocessed Criteo data: one fixed-width record per row, and the names
in its ``manifest.json`` (written by :mod:`~torchrec_cloud.data.criteo_preprocess`, read by
:mod:`~torchrec_cloud.data.criteo_reader`; docs/data.md describes both), with the checks of
a dataset that need no torch: its manifest (:func:`load_manifest`), every shard's size
(:func:`check_shards`, at open) and checksum (:func:`verify_shards`, ``data verify``).

A row is one little-endian record: the label, the 13 integers as they were in the TSV
(missing = 0; the reader applies the log transform) and the 26 ids, parsed from hex and
taken modulo the table sizes (int32 when every table has at most 2^31 rows), or raw in
int64 when no sizes were given::

    records = np.frombuffer(shard_bytes, dtype=record_dtype("int32"))
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np

from torchrec_cloud import checksum, storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.untrusted import (
    MAX_INT,
    MAX_ROWS,
    Fields,
    UntrustedInputError,
    integer,
    local_member,
    read_json,
    shown,
)

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


MANIFEST_MAX_BYTES = 64 << 20
"""Largest manifest read (a Criteo 1TB manifest is about 2 MB)."""
MAX_SHARDS = 1 << 20


def load_manifest(path: str) -> dict:
    """The manifest of a preprocessed dataset, checked (:func:`check_manifest`), or a
    :class:`ConfigError` saying what to do."""
    url = storage.join(path, MANIFEST)
    try:
        manifest = read_json(url, MANIFEST_MAX_BYTES)
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
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        found = manifest if isinstance(manifest, dict) else {}
        raise ConfigError(
            "dataset_path",
            f"{url} is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest "
            f"(format {shown(found.get('format'))}, version {shown(found.get('version'))})",
        )
    try:
        return check_manifest(manifest, url)
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None


def check_manifest(manifest: Any, url: str) -> dict:
    """``manifest`` if every field the reader uses has the type and range the format allows:
    shard paths inside the dataset's folder, sizes that agree with each other, split segments
    within their shard's rows (so no split holds more rows than the shards), else an
    :class:`~torchrec_cloud.untrusted.UntrustedInputError` naming the field. The shards' real
    sizes are checked against these rows when the dataset is opened (:func:`check_shards`)."""
    doc = Fields(manifest, url)
    record = doc.obj("record")
    record.text("byte_order", choices=("little",))
    fields = record.list("fields", 3)
    if len(fields) != 3:
        raise UntrustedInputError(url, "record.fields", f"must list label, dense and sparse, got {len(fields)} fields")
    sparse_dtype = record.at("fields[2]", fields[2]).text("dtype", choices=("int32", "int64"))
    row_bytes = record_dtype(sparse_dtype).itemsize
    record.int("bytes_per_row", lo=row_bytes, hi=row_bytes)
    sizes = doc.ints("num_embeddings_per_feature", CAT_FEATURES, lo=1, hi=MAX_INT, optional=True)
    if sizes is not None and len(sizes) != CAT_FEATURES:
        raise UntrustedInputError(url, "num_embeddings_per_feature", f"needs {CAT_FEATURES} values, got {len(sizes)}")
    sources = doc.list("sources", MAX_SHARDS)
    for i, source in enumerate(sources):
        entry = doc.at(f"sources[{i}]", source)
        entry.int("rows", hi=MAX_ROWS)
        entry.int("dense_min", lo=-(2**31), hi=2**31 - 1)
    shard_rows = []
    for i, shard in enumerate(doc.list("shards", MAX_SHARDS)):
        entry = doc.at(f"shards[{i}]", shard)
        entry.name("path", parts=2)
        entry.int("source", hi=len(sources) - 1)
        rows = entry.int("rows", hi=MAX_ROWS)
        entry.int("bytes", lo=rows * row_bytes, hi=rows * row_bytes, optional=True)
        entry.text(checksum.ALGORITHM, max_len=64, optional=True)
        shard_rows.append(rows)
    total = sum(shard_rows)
    if total > MAX_ROWS:
        raise UntrustedInputError(url, "shards", f"hold {total} rows together, more than {MAX_ROWS}")
    doc.int("rows", lo=total, hi=total, optional=True)
    splits = doc.mapping("splits", 3)
    if sorted(splits) != ["test", "train", "val"]:
        raise UntrustedInputError(url, "splits", f"must be train, val and test, got {shown(sorted(splits))}")
    in_splits = 0
    for name in ("train", "val", "test"):
        for i, segment in enumerate(doc.obj("splits").list(name, MAX_SHARDS)):
            field = f"splits.{name}[{i}]"
            if not isinstance(segment, list) or len(segment) != 3:
                raise UntrustedInputError(url, field, f"must be [shard, first row, end row], got {shown(segment)}")
            shard = integer(segment[0], url, field, hi=len(shard_rows) - 1)
            hi = integer(segment[2], url, field, hi=shard_rows[shard])
            lo = integer(segment[1], url, field, hi=hi)
            in_splits += hi - lo
    if in_splits > total:
        raise UntrustedInputError(url, "splits", f"hold {in_splits} rows together, more than the {total} of the shards")
    return manifest


def _exists(path: str) -> bool:
    try:
        return storage.exists(path)
    except storage.StorageError:
        return False


def _shard_sizes(path: str, manifest: dict) -> list[tuple[str, int, Optional[int]]]:
    """``(url, expected size, actual size or None if missing)`` of every shard, from one
    listing per folder of shards."""
    row_bytes = int(manifest["record"]["bytes_per_row"])
    listed: dict[str, dict[str, int]] = {}
    out = []
    for shard in manifest["shards"]:
        folder, _, name = shard["path"].rpartition("/")
        if folder not in listed:
            try:
                listed[folder] = storage.list_sizes(storage.join(path, *folder.split("/")) if folder else path)
            except storage.StorageNotFoundError:
                listed[folder] = {}
        out.append((storage.join(path, *shard["path"].split("/")), int(shard["rows"]) * row_bytes,
                    listed[folder].get(name)))  # fmt: skip
    return out


def check_shards(path: str, manifest: dict) -> None:
    """Raise a :class:`ConfigError` naming the first shard of ``manifest`` that is missing
    under ``path`` or whose size is not its rows times the record size (a copy cut short)."""
    for shard in manifest["shards"]:
        try:
            local_member(path, shard["path"], storage.join(path, MANIFEST), "shards")
        except UntrustedInputError as e:
            raise ConfigError("dataset_path", str(e)) from None
    for url, expected, actual in _shard_sizes(path, manifest):
        if actual is None:
            raise ConfigError("dataset_path", f"{url} is missing (the manifest lists {len(manifest['shards'])} "
                              "shards); copy the whole folder again, or preprocess again")  # fmt: skip
        if actual != expected:
            raise ConfigError("dataset_path", f"{url} has {actual} bytes, the manifest says {expected} "
                              "(truncated or altered); copy it again, or preprocess again")  # fmt: skip


def verify_shards(path: str, manifest: dict, threads: int = 8) -> dict[str, Any]:
    """Every shard's size and, where the manifest records one, checksum (reads every byte;
    shards in parallel). Returns ``{"shards", "bytes", "checked", "problems": [...]}``; a
    problem names the shard."""
    sized = _shard_sizes(path, manifest)
    problems = []
    for url, expected, actual in sized:
        if actual is None:
            problems.append(f"{url}: missing")
        elif actual != expected:
            problems.append(f"{url}: {actual} bytes, the manifest says {expected} (truncated or altered)")

    def check(item: tuple[tuple[str, int, Optional[int]], dict]) -> Optional[str]:
        (url, _, _), shard = item
        _, actual = checksum.file_digest(url)
        if actual != shard[checksum.ALGORITHM]:
            return f"{url}: its bytes differ from when it was written ({checksum.ALGORITHM} checksum mismatch)"
        return None

    todo = [(s, m) for s, m in zip(sized, manifest["shards"])
            if checksum.ALGORITHM in m and s[2] is not None and s[1] == s[2]]  # fmt: skip
    with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
        problems += [p for p in pool.map(check, todo) if p]
    return {
        "shards": len(sized),
        "bytes": sum(s[1] for s in sized),
        "checked": len(todo),
        "problems": problems,
    }
