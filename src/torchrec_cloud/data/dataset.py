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
file and field (:mod:`torchrec_cloud.trust`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from torchrec_cloud import checksum, storage, trust
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data.schema import Schema, parse_schema
from torchrec_cloud.trust import TrustError

FORMAT_NAME = "torchrec-cloud-shards"
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


def shard_bytes(rows: int, values: Sequence[int], row_bytes: int, value_bytes: int) -> int:
    """The size a shard of ``rows`` rows with ``values`` ids per list feature must have."""
    return rows * row_bytes + sum((rows + 1) * OFFSET_BYTES + n * value_bytes for n in values)


@dataclass
class Shard:
    url: str
    path: str
    rows: int
    bytes: int
    values: list[int]
    source: int
    digest: Optional[str]


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
                          self.dense_stats)  # fmt: skip

    @property
    def manifest_url(self) -> str:
        return storage.join(self.path, MANIFEST)

    def facts(self) -> dict[str, Any]:
        """What the run's ``start`` record says about the data: the schema and its digest."""
        return {"schema": {"name": self.schema.name, "digest": self.schema.digest(), "rows": self.manifest["rows"]}}


def is_schema_dataset(manifest: Any) -> bool:
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME


def load_dataset(path: str, manifest: Optional[dict] = None, check_files: bool = True) -> Dataset:
    """The dataset at ``path``: its manifest checked field by field, then (``check_files``)
    every shard's size as listed in its folder, before anything is read or allocated."""
    url = storage.join(path, MANIFEST)
    if manifest is None:
        manifest = trust.load_json(url)
    m = trust.mapping(manifest, url, "manifest")
    if m.get("format") != FORMAT_NAME or m.get("version") != FORMAT_VERSION:
        raise TrustError(url, "format", f"is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest "
                         f"(format {trust.shown(m.get('format'))}, version {trust.shown(m.get('version'))})")  # fmt: skip
    schema = parse_schema(m.get("schema"), f"{url} (schema)")
    tr = check_transforms(m.get("transforms"), schema, url, "transforms")
    table_sizes = tr["table_sizes"]
    from torchrec_cloud.data.transforms import id_dtype, record_dtype

    record = record_dtype(schema, table_sizes)
    list_dtype = np.dtype("<i4" if id_dtype(table_sizes) == "int32" else "<i8")
    rec = trust.mapping(m.get("record"), url, "record")
    if trust.integer(rec.get("bytes_per_row"), url, "record.bytes_per_row", 1, 1 << 20) != record.itemsize:
        raise TrustError(url, "record.bytes_per_row", f"is {rec.get('bytes_per_row')}, the schema's records have {record.itemsize}")
    if rec.get("list_dtype") != list_dtype.name:
        raise TrustError(url, "record.list_dtype", f"is {trust.shown(rec.get('list_dtype'))}, the tables need {list_dtype.name}")
    num_lists = len(schema.lists)
    shards = []
    total = 0
    entries = trust.sequence(m.get("shards"), url, "shards", 1 << 22)
    for i, entry in enumerate(entries):
        f = f"shards[{i}]"
        e = trust.mapping(entry, url, f)
        name = trust.name(e.get("path"), url, f"{f}.path", folders=(SHARD_DIR,))
        rows = trust.integer(e.get("rows"), url, f"{f}.rows", 1, trust.MAX_ROWS)
        values = [trust.integer(v, url, f"{f}.values[{j}]", 0, trust.MAX_ROWS)
                  for j, v in enumerate(trust.sequence(e.get("values"), url, f"{f}.values", 4096))]  # fmt: skip
        if len(values) != num_lists:
            raise TrustError(url, f"{f}.values", f"has {len(values)} counts, the schema has {num_lists} list features")
        size = trust.integer(e.get("bytes"), url, f"{f}.bytes", 1, 1 << 50)
        expected = shard_bytes(rows, values, record.itemsize, list_dtype.itemsize)
        if size != expected:
            raise TrustError(url, f"{f}.bytes", f"is {size}, but {rows} rows and {sum(values)} list ids take {expected}")
        digest = e.get(checksum.ALGORITHM)
        if digest is not None:
            trust.text(digest, url, f"{f}.{checksum.ALGORITHM}", 32)
        source = trust.integer(e.get("source", 0), url, f"{f}.source", 0, 1 << 30)
        shards.append(Shard(storage.join(path, *name.split("/")), name, rows, size, values, source, digest))
        total += rows
    if trust.integer(m.get("rows"), url, "rows", 0, trust.MAX_ROWS) != total:
        raise TrustError(url, "rows", f"is {m.get('rows')}, the shards hold {total}")
    splits_raw = trust.mapping(m.get("splits"), url, "splits")
    splits: dict[str, list[list[int]]] = {}
    for split in SPLITS:
        segs = []
        for k, seg in enumerate(trust.sequence(splits_raw.get(split, []), url, f"splits.{split}", 1 << 24)):
            f = f"splits.{split}[{k}]"
            seg = trust.sequence(seg, url, f, 3)
            if len(seg) != 3:
                raise TrustError(url, f, "must be [shard, first row, end row]")
            s = trust.integer(seg[0], url, f"{f}[0]", 0, max(len(shards) - 1, 0))
            lo = trust.integer(seg[1], url, f"{f}[1]", 0, shards[s].rows if shards else 0)
            hi = trust.integer(seg[2], url, f"{f}[2]", lo, shards[s].rows if shards else 0)
            segs.append([s, lo, hi])
        splits[split] = segs
    if check_files:
        check_sizes(path, shards)
    return Dataset(path, m, schema, record, list_dtype, table_sizes, shards, splits, tr["vocab"], tr["dense_stats"])


def check_transforms(raw: Any, schema: Schema, where: str, field: str) -> dict[str, Any]:
    """The ``transforms`` section of a manifest or a model config: table sizes, vocabulary
    files and dense statistics, checked against the schema."""
    t = trust.mapping(raw, where, field)
    sizes = trust.sequence(t.get("table_sizes"), where, f"{field}.table_sizes", 4096)
    if len(sizes) != len(schema.sparse):
        raise TrustError(where, f"{field}.table_sizes",
                         f"has {len(sizes)} values, the schema has {len(schema.sparse)} sparse features")  # fmt: skip
    table_sizes = []
    for i, (n, f) in enumerate(zip(sizes, schema.sparse)):
        table_sizes.append(trust.integer(n, where, f"{field}.table_sizes[{i}]", 1, f.num_embeddings))
    vocab = {}
    vocab_raw = trust.mapping(t.get("vocab", {}), where, f"{field}.vocab")
    for f, n in zip(schema.sparse, table_sizes):
        if f.mapping != "vocab":
            if f.name in vocab_raw:
                raise TrustError(where, f"{field}.vocab.{f.name}", "the schema does not map this feature by vocab")
            if n != f.num_embeddings:
                raise TrustError(where, f"{field}.table_sizes", f"{f.name} has {n} rows, its schema says {f.num_embeddings}")
            continue
        g = f"{field}.vocab.{f.name}"
        e = trust.mapping(vocab_raw.get(f.name), where, g)
        vocab[f.name] = {
            "path": trust.name(e.get("path"), where, f"{g}.path", folders=(VOCAB_DIR,)),
            "bytes": trust.integer(e.get("bytes"), where, f"{g}.bytes", 1, trust.MAX_VOCAB_BYTES),
            checksum.ALGORITHM: trust.text(e.get(checksum.ALGORITHM), where, f"{g}.{checksum.ALGORITHM}", 32),
            "size": trust.integer(e.get("size"), where, f"{g}.size", 0, f.num_embeddings - 1),
        }
        if vocab[f.name]["size"] + 1 != n:
            raise TrustError(where, f"{field}.table_sizes",
                             f"{f.name} has {n} rows, its vocabulary {vocab[f.name]['size']} ids plus row 0")  # fmt: skip
    stats = {}
    stats_raw = trust.mapping(t.get("dense_stats", {}), where, f"{field}.dense_stats")
    for f in schema.dense:
        if f.transform != "standardize" and f.fill != "mean":
            continue
        g = f"{field}.dense_stats.{f.name}"
        e = trust.mapping(stats_raw.get(f.name), where, g)
        std = trust.number(e.get("std"), where, f"{g}.std")
        if std <= 0:
            raise TrustError(where, f"{g}.std", f"must be > 0, got {std}")
        stats[f.name] = {"mean": trust.number(e.get("mean"), where, f"{g}.mean"), "std": std}
    return {"table_sizes": table_sizes, "vocab": vocab, "dense_stats": stats}


def check_sizes(path: str, shards: list[Shard]) -> None:
    """Every shard listed in its folder with the size the manifest gives (one listing)."""
    try:
        listed = storage.list_sizes(storage.join(path, SHARD_DIR))
    except storage.StorageNotFoundError:
        listed = {}
    for s in shards:
        actual = listed.get(s.path.rsplit("/", 1)[-1])
        if actual is None:
            raise TrustError(s.url, "", f"is missing (the manifest lists {len(shards)} shards); "
                             "copy the whole folder again, or preprocess again")  # fmt: skip
        if actual != s.bytes:
            raise TrustError(s.url, "", f"has {actual} bytes, the manifest says {s.bytes} (truncated or altered); copy it again")


def read_vocabularies(folder: str, entries: dict[str, dict], where: str) -> dict[str, list]:
    """Each feature's vocabulary (its ids in row order), read from ``folder`` after its size is
    checked against ``entries`` and its bytes against the checksum."""
    out = {}
    for name, e in entries.items():
        url = storage.join(folder, *e["path"].split("/"))
        data = trust.read_capped(url, trust.MAX_VOCAB_BYTES, e["bytes"])
        if checksum.digest(data) != e[checksum.ALGORITHM]:
            raise TrustError(url, "", f"its bytes differ from when it was written ({checksum.ALGORITHM} checksum mismatch)")
        import json

        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as err:
            raise TrustError(url, "", f"is not valid JSON ({trust.shown(str(err), 120)})") from None
        values = trust.sequence(trust.mapping(doc, url, "vocabulary").get("values"), url, "values", e["size"])
        if len(values) != e["size"]:
            raise TrustError(url, "values", f"has {len(values)} ids, {where} says {e['size']}")
        kinds = {type(v) for v in values}
        if not kinds <= {str} and not kinds <= {int}:
            raise TrustError(url, "values", "must be all strings or all integers")
        if len(set(values)) != len(values):
            raise TrustError(url, "values", "lists an id twice")
        out[name] = values
    return out


def read_manifest(path: str) -> dict:
    """The manifest at ``path`` as JSON, size-capped, or a ConfigError saying what to do."""
    url = storage.join(path, MANIFEST)
    try:
        return trust.load_json(url)
    except storage.StorageNotFoundError:
        if storage.exists(storage.join(path, "_plan.json")):
            hint = "an interrupted preprocessing run: run the same command again to finish it"
        else:
            hint = (f"make it with: torchrec-cloud data preprocess --schema FILE --input FILES --output {path}, "
                    "or --format kaggle|terabyte for Criteo")  # fmt: skip
        raise ConfigError("dataset_path", f"{url} not found ({hint})") from None
    except trust.TrustError as e:
        raise ConfigError("dataset_path", str(e)) from None


def model_features(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the model's features taken from its dataset's manifest when the dataset was
    made from a schema: dense count, sparse names, table sizes, pooling (else ``cfg``)."""
    if cfg.data.dataset_path is None:
        return cfg
    from torchrec_cloud.data.criteo_format import FORMAT_NAME as CRITEO_FORMAT

    try:
        manifest = read_manifest(cfg.data.dataset_path)
    except ConfigError:
        raise
    except storage.StorageError as e:
        raise ConfigError("dataset_path", str(e)) from None
    if isinstance(manifest, dict) and manifest.get("format") == CRITEO_FORMAT:
        return cfg
    try:
        ds = load_dataset(cfg.data.dataset_path, manifest, check_files=False)
    except trust.TrustError as e:
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
