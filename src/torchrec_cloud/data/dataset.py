"""The stored form of a dataset made from a schema: shards of fixed-width records plus list
features, their ``manifest.json`` (written by :mod:`~torchrec_cloud.data.preprocess`, read by
:mod:`~torchrec_cloud.data.reader`, ``export`` and ``predict``), and the checks that make a
manifest from a bucket safe to act on (:func:`load_dataset`)::

    ds = load_dataset("s3://bucket/events")      # validated; shards' sizes listed and checked
    ds.record, ds.list_dtype, ds.shards, ds.splits, ds.transforms()

A shard is one file: ``rows`` records (:func:`~torchrec_cloud.data.transforms.record_dtype`:
label int32, dense float32, single-valued ids int32/int64 with -1 for a missing id), then for
each list feature, in schema order, its offsets (int64, ``rows + 1`` of them, from 0: the
KeyedJaggedTensor's lengths are their differences) and its ids (``values`` of them). Every
section's place follows from ``rows`` and the ``values`` counts in the manifest, so a range
of rows is one byte range per section. Rows of a shard are grouped by split (train, val,
test; ``splits`` counts them). docs/data.md shows a manifest.

Everything a manifest says is checked before it is used (types, ranges, names relative to
the folder, sizes that add up, each shard's file size as listed), with one line naming the
file and field (:mod:`torchrec_cloud.untrusted`). Criteo, the built-in schema, writes the
same format (``schema.builtin: criteo``, :func:`is_criteo_dataset`): its record and
transforms are checked by :mod:`~torchrec_cloud.data.criteo_format`, its shards and splits
(:func:`check_layout`) and the shards' files (:func:`check_sizes`, :func:`verify_files`) by
the code here; a Criteo dataset of an older version is refused (:func:`refuse_old_criteo`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from torchrec_cloud import checksum, storage
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data.schema import Schema, is_criteo, parse_schema
from torchrec_cloud.untrusted import (
    MAX_FILE_BYTES,
    MAX_ROWS,
    Fields,
    UntrustedInputError,
    integer,
    local_member,
    number,
    parse_json,
    read_capped,
    read_json,
    shown,
)

FORMAT_NAME = "torchrec-cloud-shards"
# The format of Criteo datasets written before Criteo became the built-in schema: refused,
# with the command that rewrites one (:func:`refuse_old_criteo`).
OLD_CRITEO_FORMAT = "torchrec-cloud-criteo-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
VOCAB_DIR = "vocab"
SPLITS = ("train", "val", "test")
OFFSET_BYTES = 8


@dataclass
class Rows:
    """Rows read or converted: records, each list feature's (offsets from 0, ids), and for
    Criteo's layout a per-row dense shift (None otherwise)."""

    records: np.ndarray
    lists: list[tuple[np.ndarray, np.ndarray]]
    shift: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.records)

    @staticmethod
    def concat(parts: Sequence["Rows"], dtype: np.dtype, num_lists: int, list_dtype: Any = np.int32) -> "Rows":
        if len(parts) == 1:
            return parts[0]
        if not parts:
            empty = [(np.zeros(1, np.int64), np.zeros(0, list_dtype)) for _ in range(num_lists)]
            return Rows(np.zeros(0, dtype), empty, None)
        records = np.concatenate([p.records for p in parts])
        shift = np.concatenate([p.shift for p in parts]) if parts[0].shift is not None else None
        lists = []
        for j in range(num_lists):
            offsets, values, base = [np.zeros(1, np.int64)], [], 0
            for p in parts:
                o, v = p.lists[j]
                offsets.append(o[1:] + base)
                values.append(v)
                base += int(o[-1])
            lists.append((np.concatenate(offsets), np.concatenate(values)))
        return Rows(records, lists, shift)

    def take(self, index: np.ndarray) -> "Rows":
        """Rows ``index`` (a permutation or a subset), in that order."""
        lists = []
        for offsets, values in self.lists:
            lengths = np.diff(offsets)[index]
            new = np.zeros(len(index) + 1, np.int64)
            np.cumsum(lengths, out=new[1:])
            starts = offsets[:-1][index]
            gather = np.repeat(starts - new[:-1], lengths) + np.arange(int(new[-1]))
            lists.append((new, values[gather]))
        return Rows(self.records[index], lists, None if self.shift is None else self.shift[index])

    def slice(self, lo: int, hi: int) -> "Rows":
        hi = min(hi, len(self))
        lists = [(o[lo : hi + 1] - o[lo], v[int(o[lo]) : int(o[hi])]) for o, v in self.lists]
        return Rows(self.records[lo:hi], lists, None if self.shift is None else self.shift[lo:hi])

    def padded(self, size: int, shift_fill: int = -2) -> "Rows":
        """These rows followed by all-zero rows up to ``size`` (no ids in their lists)."""
        extra = size - len(self)
        if extra <= 0:
            return self
        records = np.concatenate((self.records, np.zeros(extra, self.records.dtype)))
        lists = [(np.concatenate((o, np.full(extra, o[-1], np.int64))), v) for o, v in self.lists]
        shift = None if self.shift is None else np.concatenate((self.shift, np.full(extra, shift_fill, np.int64)))
        return Rows(records, lists, shift)

    def pack(self) -> bytes:
        """The shard bytes of these rows."""
        parts = [self.records.tobytes()]
        for offsets, values in self.lists:
            parts += [offsets.astype("<i8").tobytes(), values.tobytes()]
        return b"".join(parts)


def record_section(record: np.dtype, **extra: Any) -> dict[str, Any]:
    """A manifest's ``record``: the row's little-endian fields as both formats describe them
    (Criteo's and a schema's), with ``extra`` keys."""
    fields = [{"name": n, "dtype": record[n].base.name, "shape": list(record[n].shape)} for n in record.names]
    return {"byte_order": "little", "bytes_per_row": record.itemsize, "fields": fields, **extra}


def shard_bytes(rows: int, values: Sequence[int], row_bytes: int, value_bytes: int) -> int:
    """The size a shard of ``rows`` rows with ``values`` ids per list feature must have."""
    return rows * row_bytes + sum((rows + 1) * OFFSET_BYTES + n * value_bytes for n in values)


MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest (or schema, or model config section) read whole; a Criteo 1TB manifest is about 2 MB."""
MAX_SHARDS = 1 << 20
MAX_VOCAB_BYTES = 2 << 30
"""One vocabulary file (its size is also recorded in the manifest and read no further)."""


@dataclass
class Shard:
    url: str
    path: str
    rows: int
    bytes: int
    values: list[int]
    source: int
    digest: Optional[str]


def check_shard(entry: Fields, folder: str, row_bytes: int, num_lists: int = 0, value_bytes: int = 0,
                sources: int = MAX_SHARDS, sizes_optional: bool = False) -> Shard:  # fmt: skip
    """One shard's entry of a manifest (Criteo's or a schema's) or of a preprocessing run's
    record, checked: its path a name inside ``folder`` (at most one sub-folder), its rows in
    range, its ``bytes`` what those rows (and, per list feature, ``values`` ids) take, its
    source one of ``sources``. ``sizes_optional``: Criteo manifests written before sizes were
    recorded lack ``bytes``, which then follows from the rows."""
    path = entry.name("path", parts=2)
    source = entry.int("source", hi=sources - 1)
    rows = entry.int("rows", hi=MAX_ROWS)
    values = entry.ints("values", num_lists, hi=MAX_ROWS, optional=num_lists == 0) or []
    if len(values) != num_lists:
        raise UntrustedInputError(entry.file, entry.field("values"),
                                  f"has {len(values)} counts, the schema has {num_lists} list features")  # fmt: skip
    expected = shard_bytes(rows, values, row_bytes, value_bytes)
    size = entry.int("bytes", hi=MAX_FILE_BYTES, optional=sizes_optional)
    if size is None:
        size = expected
    elif size != expected:
        ids = f" and {sum(values)} list ids" if num_lists else ""
        raise UntrustedInputError(entry.file, entry.field("bytes"), f"is {size}, but {rows} rows{ids} take {expected}")
    digest = entry.text(checksum.ALGORITHM, max_len=64, optional=True)
    return Shard(storage.join(folder, *path.split("/")), path, rows, size, values, source, digest)


def check_layout(doc: Fields, folder: str, row_bytes: int, num_lists: int = 0, value_bytes: int = 0,
                 sizes_optional: bool = False) -> tuple[list[Shard], dict[str, list[list[int]]]]:  # fmt: skip
    """The ``shards`` and ``splits`` of a dataset's manifest, Criteo's or a schema's, checked
    before anything is read or allocated from them: every shard as :func:`check_shard` says,
    the rows together within :data:`MAX_ROWS` and equal to ``rows``, and ``splits`` train, val
    and test, each a list of ``[shard, first row, end row]`` within that shard's rows, holding
    no more rows together than the shards. The shards' real sizes are checked against these
    when the dataset is opened (:func:`check_sizes`)."""
    sources = len(doc.list("sources", MAX_SHARDS))
    shards = [check_shard(doc.at(f"shards[{i}]", raw), folder, row_bytes, num_lists, value_bytes, sources, sizes_optional)
              for i, raw in enumerate(doc.list("shards", MAX_SHARDS))]  # fmt: skip
    total = sum(s.rows for s in shards)
    if total > MAX_ROWS:
        raise UntrustedInputError(doc.file, "shards", f"hold {total} rows together, more than {MAX_ROWS}")
    doc.int("rows", lo=total, hi=total, optional=sizes_optional)
    names = doc.mapping("splits", len(SPLITS))
    if sorted(names) != sorted(SPLITS):
        raise UntrustedInputError(doc.file, "splits", f"must be train, val and test, got {shown(sorted(map(str, names)))}")
    splits: dict[str, list[list[int]]] = {}
    in_splits = 0
    for name in SPLITS:
        splits[name] = []
        for i, segment in enumerate(doc.obj("splits").list(name, MAX_SHARDS)):
            field = f"splits.{name}[{i}]"
            if not isinstance(segment, list) or len(segment) != 3:
                raise UntrustedInputError(doc.file, field, f"must be [shard, first row, end row], got {shown(segment)}")
            shard = integer(segment[0], doc.file, field, hi=len(shards) - 1)
            hi = integer(segment[2], doc.file, field, hi=shards[shard].rows)
            lo = integer(segment[1], doc.file, field, hi=hi)
            splits[name].append([shard, lo, hi])
            in_splits += hi - lo
    if in_splits > total:
        raise UntrustedInputError(doc.file, "splits", f"hold {in_splits} rows together, more than the {total} of the shards")
    return shards, splits


def file_sizes(folder: str, names: Sequence[str]) -> list[tuple[str, Optional[int]]]:
    """``(url, size or None if missing)`` of each file ``names`` gives (checked names inside
    ``folder``), from one listing per sub-folder. A local name that is a link out of the
    folder or not a regular file (``/dev/zero``) is an :class:`UntrustedInputError`."""
    listed: dict[str, dict[str, int]] = {}
    out = []
    for rel in names:
        local_member(folder, rel, storage.join(folder, MANIFEST), "shards")
        sub, _, name = rel.rpartition("/")
        if sub not in listed:
            try:
                listed[sub] = storage.list_sizes(storage.join(folder, *sub.split("/")) if sub else folder)
            except storage.StorageNotFoundError:
                listed[sub] = {}
        out.append((storage.join(folder, *rel.split("/")), listed[sub].get(name)))
    return out


def check_sizes(folder: str, shards: Sequence[Shard]) -> None:
    """Every shard listed in its folder with the size the manifest gives (one listing per
    sub-folder, nothing read): an :class:`UntrustedInputError` naming the first that is
    missing or of another size."""
    for s, (url, actual) in zip(shards, file_sizes(folder, [s.path for s in shards])):
        if actual is None:
            raise UntrustedInputError(url, "", f"is missing (the manifest lists {len(shards)} shards); "
                                      "copy the whole folder again, or preprocess again")  # fmt: skip
        if actual != s.bytes:
            raise UntrustedInputError(url, "", f"has {actual} bytes, the manifest says {s.bytes} (truncated or altered); "
                                      "copy it again, or preprocess again")  # fmt: skip


def verify_files(folder: str, shards: Sequence[Shard], threads: int = 8) -> dict[str, Any]:
    """Every shard's size and, where the manifest records one, checksum (reads every byte;
    shards in parallel), for ``data verify`` of any dataset. Returns ``{"shards", "bytes",
    "checked", "problems": [...]}``; a problem names the shard."""
    from concurrent.futures import ThreadPoolExecutor

    sized = file_sizes(folder, [s.path for s in shards])
    problems = []
    for s, (url, actual) in zip(shards, sized):
        if actual is None:
            problems.append(f"{url}: missing")
        elif actual != s.bytes:
            problems.append(f"{url}: {actual} bytes, the manifest says {s.bytes} (truncated or altered)")

    def check(item: tuple[str, str]) -> Optional[str]:
        url, expected_digest = item
        _, actual = checksum.file_digest(url)
        if actual != expected_digest:
            return f"{url}: its bytes differ from when it was written ({checksum.ALGORITHM} checksum mismatch)"
        return None

    todo = [(url, s.digest) for s, (url, actual) in zip(shards, sized) if s.digest is not None and actual == s.bytes]
    with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
        problems += [p for p in pool.map(check, todo) if p]
    return {"shards": len(shards), "bytes": sum(s.bytes for s in shards), "checked": len(todo), "problems": problems}


@dataclass
class Dataset:
    """A validated manifest of a dataset made from a schema."""

    path: str
    manifest: dict
    schema: Schema
    record: np.dtype
    list_dtype: np.dtype
    table_sizes: list[int]
    shards: list[Shard]
    splits: dict[str, list[list[int]]]
    vocab_files: dict[str, dict]  # feature -> {"path", "bytes", "xxh3_64", "size"}
    dense_stats: dict[str, dict[str, float]]
    boundaries: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # bucketized feature -> its boundaries

    def list_offset(self, shard: Shard, j: int) -> int:
        """Byte offset of list feature ``j``'s offsets in ``shard``."""
        pos = shard.rows * self.record.itemsize
        for k in range(j):
            pos += (shard.rows + 1) * OFFSET_BYTES + shard.values[k] * self.list_dtype.itemsize
        return pos

    def transforms(self) -> Any:
        """The :class:`~torchrec_cloud.data.transforms.Transforms` that made the shards (reads
        the vocabularies, checked against their sizes and checksums in the manifest)."""
        from torchrec_cloud.data.transforms import Transforms

        return Transforms(self.schema, read_vocabularies(self.path, self.vocab_files, self.manifest_url),
                          self.dense_stats, self.boundaries)  # fmt: skip

    @property
    def manifest_url(self) -> str:
        return storage.join(self.path, MANIFEST)

    @property
    def digest(self) -> str:
        """The digest of the transforms that made the shards (:func:`transforms_digest`)."""
        return transforms_digest(self.schema, self.manifest["transforms"])

    def facts(self) -> dict[str, Any]:
        """What the run's ``start`` record says about the data: the schema and its digest, and
        the transforms a checkpoint pins (``pinned_transforms``)."""
        return {"schema": {"name": self.schema.name, "digest": self.schema.digest(), "rows": self.manifest["rows"]},
                PINNED: {"kind": "schema", "digest": self.digest}}  # fmt: skip


PINNED = "pinned_transforms"
"""The key of the transforms a model was trained with (``{"kind", "digest"}``) in a run's
start record, a checkpoint's COMMIT.json and a model's model_config.json."""
PIN_KINDS = ("schema", "criteo")


def transforms_digest(schema: Schema, transforms: dict[str, Any]) -> str:
    """The digest that pins the transforms of a dataset made from a schema to the models
    trained on it: SHA-256 of one canonical JSON text of the schema's features with their
    rules (label, fills, dense transforms, hash / vocab / modulo mappings, table sizes,
    pooling, how a CSV is read) and of the whole ``transforms`` section of the manifest (or of
    a model config, which export copies from it): table sizes, each vocabulary's checksum,
    size and bytes, the dense statistics, and any kind of transform stored there later. Left
    out: the schema's split (it picks rows, it transforms none; a split that changes which rows
    train changes the vocabularies and statistics, so the digest too) and the vocabulary
    files' paths (their checksums pin what they hold). SHA-256, not the XXH3 of the files'
    checksums: this digest is what a checkpoint, written elsewhere, is compared with."""
    rules = schema.to_dict()
    rules.pop("split", None)
    section = json.loads(json.dumps(transforms))
    for entry in (section.get("vocab") or {}).values():
        entry.pop("path", None)
    return _sha256({"kind": "schema", "schema": rules, "transforms": section})


def criteo_digest(table_sizes: Sequence[int]) -> str:
    """The digest of Criteo's transforms for tables of ``table_sizes`` rows: its ids parsed
    from hex and taken modulo the table sizes (when preprocessing, or when read); its dense
    transform is the model's own (``--dense_transform``, in its config)."""
    return _sha256({"kind": "criteo", "modulo": [int(n) for n in table_sizes]})


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def pinned_of(raw: Any, where: str) -> Optional[dict[str, str]]:
    """A recorded ``pinned_transforms`` (from a COMMIT.json or a model config), checked: None
    when absent (a run on synthetic data or a --data_source pins none)."""
    if raw is None:
        return None
    f = Fields(raw, where, PINNED)
    digest = f.text("digest", 64)
    if not all(c in "0123456789abcdef" for c in digest) or len(digest) != 64:
        raise UntrustedInputError(where, f.field("digest"), f"must be 64 hex digits, got {shown(digest)}")
    return {"kind": f.text("kind", choices=PIN_KINDS), "digest": digest}


def short(digest: str) -> str:
    """A digest as messages show it (its first 16 hex digits)."""
    return digest[:16]


def is_schema_dataset(manifest: Any) -> bool:
    """A manifest of a dataset made from a user's schema (not the built-in Criteo one)."""
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME and not is_criteo(manifest.get("schema"))


def is_criteo_dataset(manifest: Any) -> bool:
    """A manifest of a dataset made from Criteo's TSV, the built-in schema."""
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME and is_criteo(manifest.get("schema"))


def refuse_old_criteo(manifest: Any, path: str) -> None:
    """A :class:`ConfigError` for a Criteo dataset written by an older version (its own
    format, before Criteo was the built-in schema), naming the command that rewrites it."""
    if not isinstance(manifest, dict) or manifest.get("format") != OLD_CRITEO_FORMAT:
        return
    kind = manifest.get("dataset") if manifest.get("dataset") in ("kaggle", "terabyte") else "kaggle|terabyte"
    sources = manifest.get("sources")
    inputs = [s["path"] for s in sources if isinstance(s, dict) and isinstance(s.get("path"), str)] if isinstance(sources, list) else []
    shown_inputs = " ".join(shown(p, 200) for p in inputs[:4]) + (" ..." if len(inputs) > 4 else "") if inputs else "FILES"
    sizes = manifest.get("num_embeddings_per_feature")
    tables = (f" --num_embeddings_per_feature {','.join(str(n) for n in sizes)}"
              if isinstance(sizes, list) and all(type(n) is int for n in sizes) else "")  # fmt: skip
    raise ConfigError("dataset_path", f"{storage.join(path, MANIFEST)} was written by an older version "
                      f"({OLD_CRITEO_FORMAT}); rewrite it with: torchrec-cloud data preprocess --format {kind} "
                      f"--input {shown_inputs} --output NEW_FOLDER{tables}")  # fmt: skip


def load_dataset(path: str, manifest: Optional[dict] = None, check_files: bool = True) -> Dataset:
    """The dataset at ``path``: its manifest checked field by field, then (``check_files``)
    every shard's size as listed in its folder, before anything is read or allocated; an
    :class:`UntrustedInputError` naming the file and field otherwise."""
    url = storage.join(path, MANIFEST)
    if manifest is None:
        manifest = read_json(url, MAX_MANIFEST_BYTES)
    doc = Fields(manifest, url)
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise UntrustedInputError(url, "format", f"is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest "
                                  f"(format {shown(manifest.get('format'))}, version {shown(manifest.get('version'))})")  # fmt: skip
    schema = parse_schema(doc.get("schema"), f"{url} (schema)")
    tr = check_transforms(doc.get("transforms"), schema, url, "transforms")
    table_sizes = tr["table_sizes"]
    from torchrec_cloud.data.transforms import id_dtype, record_dtype

    record = record_dtype(schema, table_sizes)
    list_dtype = np.dtype("<i4" if id_dtype(table_sizes) == "int32" else "<i8")
    rec = doc.obj("record")
    rec.int("bytes_per_row", lo=record.itemsize, hi=record.itemsize)
    rec.text("list_dtype", choices=(list_dtype.name,))
    shards, splits = check_layout(doc, path, record.itemsize, len(schema.lists), list_dtype.itemsize)
    if check_files:
        check_sizes(path, shards)
    return Dataset(path, manifest, schema, record, list_dtype, table_sizes, shards, splits, tr["vocab"], tr["dense_stats"],
                   tr["boundaries"])  # fmt: skip


def check_transforms(raw: Any, schema: Schema, where: str, field: str) -> dict[str, Any]:
    """The ``transforms`` section of a manifest or a model config: table sizes, vocabulary
    files and dense statistics, checked against the schema."""
    t = Fields(raw, where, field)
    table_sizes = t.ints("table_sizes", len(schema.sparse), lo=1)
    if len(table_sizes) != len(schema.sparse):
        raise UntrustedInputError(where, t.field("table_sizes"),
                                  f"has {len(table_sizes)} values, the schema has {len(schema.sparse)} sparse features")  # fmt: skip
    for i, (n, f) in enumerate(zip(table_sizes, schema.sparse)):
        integer(n, where, f"{t.field('table_sizes')}[{i}]", 1, f.num_embeddings)
    vocab = {}
    vocab_raw = t.obj("vocab", optional=True) or Fields({}, where, t.field("vocab"))
    for f, n in zip(schema.sparse, table_sizes):
        if f.mapping != "vocab":
            if vocab_raw.has(f.name):
                raise UntrustedInputError(where, vocab_raw.field(f.name), "the schema does not map this feature by vocab")
            if n != f.num_embeddings:
                raise UntrustedInputError(where, t.field("table_sizes"), f"{f.name} has {n} rows, its schema says {f.num_embeddings}")
            continue
        e = vocab_raw.obj(f.name)
        vocab[f.name] = {
            "path": e.name("path", parts=2),
            "bytes": e.int("bytes", lo=1, hi=MAX_VOCAB_BYTES),
            checksum.ALGORITHM: e.text(checksum.ALGORITHM, max_len=64),
            "size": e.int("size", hi=f.num_embeddings - 1),
        }
        if vocab[f.name]["bytes"] < min_vocab_bytes(vocab[f.name]["size"]):
            raise UntrustedInputError(where, e.field("size"), f"{vocab[f.name]['size']} distinct ids cannot fit in the "
                                      f"{vocab[f.name]['bytes']} bytes its file has (altered manifest)")  # fmt: skip
        if vocab[f.name]["size"] + 1 != n:
            raise UntrustedInputError(where, t.field("table_sizes"),
                                      f"{f.name} has {n} rows, its vocabulary {vocab[f.name]['size']} ids plus row 0")  # fmt: skip
    stats = {}
    stats_raw = t.obj("dense_stats", optional=True) or Fields({}, where, t.field("dense_stats"))
    for f in schema.dense:
        if f.transform != "standardize" and f.fill != "mean":
            continue
        e = stats_raw.obj(f.name)
        stats[f.name] = {"mean": e.number("mean"), "std": e.number("std", lo=1e-300)}
    return {"table_sizes": table_sizes, "vocab": vocab, "dense_stats": stats, "boundaries": check_boundaries(t, schema)}


def check_boundaries(t: Fields, schema: Schema) -> dict[str, list[float]]:
    """The ``boundaries`` of a ``transforms`` section: increasing finite numbers, fewer than
    each bucketized feature's buckets."""
    raw = t.obj("boundaries", optional=True) or Fields({}, t.file, t.field("boundaries"))
    out = {}
    for f in schema.sparse:
        if f.mapping != "bucketize":
            if raw.has(f.name):
                raise UntrustedInputError(t.file, raw.field(f.name), "the schema does not bucketize this feature")
            continue
        where = raw.field(f.name)
        values = [number(v, t.file, f"{where}[{i}]") for i, v in enumerate(raw.list(f.name, f.num_embeddings - 2))]
        if any(b <= a for a, b in zip(values, values[1:])):
            raise UntrustedInputError(t.file, where, "must increase")
        out[f.name] = values
    return out


def min_vocab_bytes(size: int) -> int:
    """The fewest bytes a vocabulary file of ``size`` distinct ids can take: each id at least
    one character and a separator, so a manifest cannot claim millions of ids (and tables of
    millions of rows) for a small file."""
    return 2 * size


def check_vocabularies(folder: str, entries: dict[str, dict], where: str) -> list[str]:
    """Every vocabulary file against the manifest ``where`` (its size, checksum and count of
    distinct ids), read whole: one line per file that is missing or differs, for ``data
    verify`` and for ``train`` before its first step (a reversed vocabulary has the size the
    manifest records, and would train every id on another id's row)."""
    problems = []
    for url, e in _vocab_files(folder, entries).values():
        try:
            _vocabulary(url, e, where)
        except storage.StorageNotFoundError:
            problems.append(f"{url}: missing (the manifest lists it); preprocess again")
        except (UntrustedInputError, storage.StorageError) as err:
            problems.append(f"{err}; preprocess again")
    return problems


def read_vocabularies(folder: str, entries: dict[str, dict], where: str) -> dict[str, list]:
    """Each feature's vocabulary (its ids in row order), read from ``folder`` no further than
    the size ``entries`` records, and checked against its checksum."""
    return {name: _vocabulary(url, e, where) for name, (url, e) in _vocab_files(folder, entries).items()}


def vocabulary_bytes(folder: str, entries: dict[str, dict]) -> dict[str, bytes]:
    """Each vocabulary file's bytes (by its path in the folder), size- and checksum-checked:
    what ``export`` copies into a model folder."""
    return {e["path"]: _vocab_data(url, e) for url, e in _vocab_files(folder, entries).values()}


def _vocab_files(folder: str, entries: dict[str, dict]) -> dict[str, tuple[str, dict]]:
    out = {}
    for name, e in entries.items():
        local_member(folder, e["path"], storage.join(folder, MANIFEST), f"transforms.vocab.{name}.path")
        out[name] = (storage.join(folder, *e["path"].split("/")), e)
    return out


def _vocab_data(url: str, e: dict) -> bytes:
    data = read_capped(url, MAX_VOCAB_BYTES, e["bytes"])
    if checksum.digest(data) != e[checksum.ALGORITHM]:
        raise UntrustedInputError(url, "", f"its bytes differ from when it was written ({checksum.ALGORITHM} checksum mismatch)")
    return data


def _vocabulary(url: str, e: dict, where: str) -> list:
    values = Fields(parse_json(_vocab_data(url, e), url), url).list("values", e["size"])
    if len(values) != e["size"]:
        raise UntrustedInputError(url, "values", f"has {len(values)} ids, {where} says {e['size']}")
    kinds = {type(v) for v in values}
    if not kinds <= {str} and not kinds <= {int}:
        raise UntrustedInputError(url, "values", "must be all strings or all integers")
    if len(set(values)) != len(values):
        raise UntrustedInputError(url, "values", "lists an id twice")
    return values


def read_manifest(path: str) -> dict:
    """The manifest at ``path`` as JSON, size-capped, or a ConfigError saying what to do."""
    url = storage.join(path, MANIFEST)
    try:
        manifest = read_json(url, MAX_MANIFEST_BYTES)
    except storage.StorageNotFoundError:
        if storage.exists(storage.join(path, "_plan.json")):
            hint = "an interrupted preprocessing run: run the same command again to finish it"
        else:
            hint = (f"make it with: torchrec-cloud data preprocess --schema FILE --input FILES --output {path}, "
                    "or --format kaggle|terabyte for Criteo")  # fmt: skip
        raise ConfigError("dataset_path", f"{url} not found ({hint})") from None
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None
    refuse_old_criteo(manifest, path)
    return manifest


def model_features(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the model's features taken from its dataset's manifest when the dataset was
    made from a schema: dense count, sparse names, table sizes, pooling (else ``cfg``)."""
    if cfg.data.dataset_path is None:
        return cfg
    try:
        manifest = read_manifest(cfg.data.dataset_path)
    except ConfigError:
        raise
    except storage.StorageError as e:
        raise ConfigError("dataset_path", str(e)) from None
    if is_criteo_dataset(manifest):
        return cfg  # Criteo's features are the model's flags (13 dense, 26 sparse; --num_embeddings...)
    try:
        ds = load_dataset(cfg.data.dataset_path, manifest, check_files=False)
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None
    if cfg.data.multi_hot_sizes is not None:
        raise ConfigError("multi_hot_sizes", "applies to Criteo data; a schema's list features are bags of their own")
    sparse = ds.schema.sparse
    model = dataclasses.replace(
        cfg.model,
        num_dense_features=len(ds.schema.dense),
        num_sparse_features=len(sparse),
        num_embeddings_per_feature=list(ds.table_sizes),
        feature_names=[f.name for f in sparse],
        pooling=[f.pooling for f in sparse],
    )
    return dataclasses.replace(cfg, model=model)
