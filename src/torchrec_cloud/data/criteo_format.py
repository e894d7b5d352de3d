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

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np

from torchrec_cloud import checksum, storage
from torchrec_cloud.config import ConfigError

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


def load_manifest(path: str) -> dict:
    """The manifest of a preprocessed dataset, or a :class:`ConfigError` saying what to do."""
    url = storage.join(path, MANIFEST)
    try:
        manifest = json.loads(storage.read_bytes(url))
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("dataset_path", f"{url} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        found = manifest if isinstance(manifest, dict) else {}
        raise ConfigError(
            "dataset_path",
            f"{url} is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest "
            f"(format {found.get('format')!r}, version {found.get('version')!r})",
        )
    return manifest


def _exists(path: str) -> bool:
    try:
        return storage.exists(path)
    except storage.StorageError:
        return False


def _shard_sizes(path: str, entries: list[tuple[str, int]]) -> list[tuple[str, int, Optional[int]]]:
    """``(url, expected size, actual size or None if missing)`` of every shard named in
    ``entries`` (``(path in the folder, size)``), from one listing per folder of shards."""
    listed: dict[str, dict[str, int]] = {}
    out = []
    for rel, expected in entries:
        folder, _, name = rel.rpartition("/")
        if folder not in listed:
            try:
                listed[folder] = storage.list_sizes(storage.join(path, *folder.split("/")) if folder else path)
            except storage.StorageNotFoundError:
                listed[folder] = {}
        out.append((storage.join(path, *rel.split("/")), expected, listed[folder].get(name)))
    return out


def _entries(manifest: dict) -> list[tuple[str, int]]:
    row_bytes = int(manifest["record"]["bytes_per_row"])
    return [(shard["path"], int(shard["rows"]) * row_bytes) for shard in manifest["shards"]]


def check_shards(path: str, manifest: dict) -> None:
    """Raise a :class:`ConfigError` naming the first shard of ``manifest`` that is missing
    under ``path`` or whose size is not its rows times the record size (a copy cut short)."""
    for url, expected, actual in _shard_sizes(path, _entries(manifest)):
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
    return verify_files(path, _entries(manifest), [s.get(checksum.ALGORITHM) for s in manifest["shards"]], threads)


def verify_files(path: str, entries: list[tuple[str, int]], digests: list[Optional[str]], threads: int = 8) -> dict[str, Any]:
    """:func:`verify_shards` of files named by ``(path in the folder, size)`` with their
    checksums (None: size only); any dataset's shards."""
    sized = _shard_sizes(path, entries)
    problems = []
    for url, expected, actual in sized:
        if actual is None:
            problems.append(f"{url}: missing")
        elif actual != expected:
            problems.append(f"{url}: {actual} bytes, the manifest says {expected} (truncated or altered)")

    def check(item: tuple[tuple[str, int, Optional[int]], str]) -> Optional[str]:
        (url, _, _), expected_digest = item
        _, actual = checksum.file_digest(url)
        if actual != expected_digest:
            return f"{url}: its bytes differ from when it was written ({checksum.ALGORITHM} checksum mismatch)"
        return None

    todo = [(s, d) for s, d in zip(sized, digests) if d is not None and s[2] is not None and s[1] == s[2]]
    with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
        problems += [p for p in pool.map(check, todo) if p]
    return {
        "shards": len(sized),
        "bytes": sum(s[1] for s in sized),
        "checked": len(todo),
        "problems": problems,
    }
