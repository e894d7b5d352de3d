"""The schema of a dataset: which column is the label, which are dense and sparse features, and
how each raw value becomes a model input. A small YAML file the user writes (or edits from
what ``torchrec-cloud data schema --input URL`` proposes, :mod:`~torchrec_cloud.data.infer`)::

    name: events
    label: {column: clicked}                    # 0/1; {column: rating, threshold: 4}; {column: outcome, positive: [buy]}
    dense:
      - {name: price, transform: log1p}         # none | log1p | standardize | bucketize; fill: 0 or mean
      - {name: age, transform: standardize}
      - {name: amount, transform: bucketize, buckets: 32, keep_dense: true}   # boundaries: label | quantiles
    sparse:
      - {name: user_id, type: string, mapping: vocab, num_embeddings: 100000, min_count: 2, evict_after: 30}
      - {name: item_id, type: int, mapping: hash, num_embeddings: 50000}
      - {name: tags, type: string, list: true, mapping: vocab, num_embeddings: 1000, pooling: mean}
    split: {by: ts, val_from: "2024-03-01", test_from: "2024-03-15"}

    schema = load_schema("schema.yaml")          # checked; one line naming file and field

docs/data.md describes every field. Criteo is the built-in schema (:func:`criteo_schema`,
its TSV read by its own vectorised parser); every other dataset's schema is read here.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence, Union

from torchrec_cloud.untrusted import Fields, UntrustedInputError, number, read_yaml, shown, text

FORMAT = "torchrec-cloud-schema"
TRANSFORMS = ("none", "log1p", "standardize")
MAPPINGS = ("hash", "vocab", "modulo", "bucketize")
BOUNDARIES = ("label", "quantiles")
ID_TYPES = ("string", "int")
DEFAULT_BUCKETS = 32
MAX_BUCKETS = 1024
MAX_POSITIVE = 1000
POOLINGS = ("sum", "mean")
MAX_TABLE_ROWS = 1 << 40
MAX_SCHEMA_BYTES = 1 << 20  # the most features a schema takes (2 x 4,096) at ~100 bytes a line
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class Label:
    column: str
    threshold: Optional[float] = None
    """None: the column holds 0/1 (or true/false); a number: label = value >= threshold."""
    positive: Optional[tuple[Union[str, int, float], ...]] = None
    """The values that count as 1 (text or numbers); every other value present is 0."""


@dataclass(frozen=True)
class Dense:
    name: str
    column: str
    transform: str = "none"
    fill: Union[float, str] = 0.0
    """The value a missing entry gets before the transform: a number, or ``mean`` (the
    training rows' mean, so 0 after ``standardize``)."""


@dataclass(frozen=True)
class Sparse:
    """An id feature, or a numeric column's bucket (``mapping: bucketize``, ``type: number``:
    what a dense feature's ``transform: bucketize`` becomes; its table has ``num_embeddings =
    buckets + 1`` rows, row 0 for a missing value)."""

    name: str
    column: str
    type: str = "string"
    list: bool = False
    mapping: str = "hash"
    num_embeddings: int = 100_000
    """Rows of its table (``vocab``: at most; the vocabulary found, plus one
    out-of-vocabulary row, may be fewer)."""
    min_count: int = 1
    pooling: str = "sum"
    separator: str = "|"
    """Between a list's ids in one CSV cell or string column."""
    max_length: Optional[int] = None
    """Keep the first this many ids of a list (None: all)."""
    evict_after: Optional[int] = None
    """``vocab`` with ``data preprocess --vocab_from``: a full table first evicts ids unseen for
    this many generations (one ``--vocab_from`` step each; None: the least counted only;
    :mod:`~torchrec_cloud.data.vocab`)."""
    boundaries: Optional[str] = None
    """``bucketize``: ``label`` (split where the training labels change) or None (quantiles of
    the training rows: ``boundaries: quantiles``, and every schema written before the field;
    :mod:`~torchrec_cloud.data.buckets`)."""


@dataclass(frozen=True)
class Split:
    by: str
    """A column (rows with a value below ``val_from`` train, below ``test_from`` validate,
    the rest test), ``input`` (the --input files from the one named ``val_from`` on), or
    ``hash:COLUMN`` (a stable hash of the column as a fraction in [0, 1))."""
    val_from: Any
    test_from: Any


@dataclass(frozen=True)
class Schema:
    name: str
    label: Label
    dense: tuple[Dense, ...]
    sparse: tuple[Sparse, ...]
    split: Optional[Split] = None
    delimiter: Optional[str] = None
    """CSV/TSV only: the field separator (None: ``\\t`` for .tsv/.txt, else ``,``)."""
    header: bool = True
    """CSV/TSV only: whether the first line names the columns (else give ``columns``)."""
    columns: Optional[tuple[str, ...]] = None
    """CSV/TSV without a header: the columns' names, in order."""

    def columns_read(self, split: Optional[Split] = None, labelled: bool = True) -> list[str]:
        """The input columns read (label, features, the split's column), once each."""
        out = ([self.label.column] if labelled else []) + [f.column for f in self.dense] + [f.column for f in self.sparse]
        if split is not None and split.by != "input" and split.by != "hash:":
            out.append(split.by.removeprefix("hash:"))
        return list(dict.fromkeys(out))

    @property
    def singles(self) -> list[Sparse]:
        return [f for f in self.sparse if not f.list]

    @property
    def lists(self) -> list[Sparse]:
        return [f for f in self.sparse if f.list]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for f in d["sparse"]:  # unset, they are left out: the digests of schemas written before them stay the same
            for key in ("evict_after", "boundaries"):
                if f[key] is None:
                    del f[key]
        d["format"] = FORMAT
        d["columns"] = list(self.columns) if self.columns is not None else None
        return d

    def digest(self) -> str:
        from torchrec_cloud import checksum

        return checksum.digest(json.dumps(self.to_dict(), sort_keys=True).encode())


# Criteo, the built-in schema: `data preprocess --format kaggle|terabyte` writes it into the
# manifest of every Criteo dataset (format torchrec-cloud-shards, as a schema's), which names
# it by ``builtin: criteo``: a key no user's schema may have, so no YAML file can pass for it.
# Its input is Criteo's TSV, parsed by criteo_parse (bit-identical to TorchRec's
# preprocessing, and vectorised); its ids are hexadecimal, taken modulo the table sizes; its
# 13 integers are stored as they are and transformed when read (--dense_transform: torchrec
# or log1p), since TorchRec's transform subtracts each input file's smallest value.
CRITEO_BUILTIN = "criteo"
CRITEO = {
    "name": "criteo",
    "label": {"column": "label"},
    "dense": [{"name": f"int_{i}", "transform": "criteo (--dense_transform)"} for i in range(13)],
    "sparse": [{"name": f"cat_{i}", "type": "hex", "mapping": "modulo"} for i in range(26)],
}


def criteo_schema(dataset: str, table_sizes: Optional[Sequence[int]]) -> dict[str, Any]:
    """The built-in schema as a Criteo manifest records it: ``dataset`` (kaggle or terabyte:
    how the splits are cut) and each id feature's table size (None: ids kept whole, reduced
    by the model's table sizes when read)."""
    sparse = [dict(f, num_embeddings=None if table_sizes is None else int(n))
              for f, n in zip(CRITEO["sparse"], table_sizes or [None] * len(CRITEO["sparse"]))]  # fmt: skip
    return {**CRITEO, "builtin": CRITEO_BUILTIN, "input": "criteo-tsv", "dataset": dataset,
            "dense": [dict(f, transform="torchrec|log1p, when read (--dense_transform)") for f in CRITEO["dense"]],
            "sparse": sparse}  # fmt: skip


def is_criteo(raw: Any) -> bool:
    """A recorded schema (from a manifest) is the built-in Criteo one."""
    return isinstance(raw, dict) and raw.get("builtin") == CRITEO_BUILTIN


def load_schema(path: str) -> Schema:
    """The schema in the YAML (or JSON) file at ``path``, checked."""
    return parse_schema(read_yaml(path, MAX_SCHEMA_BYTES), path)


def _keys(d: Fields, allowed: set[str]) -> None:
    unknown = sorted(map(str, set(d.data) - allowed))
    if unknown:
        raise UntrustedInputError(d.file, d.field(unknown[0]), f"unknown key (known: {', '.join(sorted(allowed))})")


def _ident(d: Fields, key: str, default: Optional[str] = None) -> str:
    value = d.text(key, 64) if default is None or d.has(key) else default
    if not _IDENT.match(value):
        raise UntrustedInputError(d.file, d.field(key), f"must be an identifier (letters, digits, _), got {shown(value)}")
    return value


def _or(d: Fields, key: str, default: Any, read: Any) -> Any:
    """``read(key)`` where ``d`` has ``key``, else ``default``."""
    return read(key) if d.has(key) else default


def parse_schema(raw: Any, where: str) -> Schema:
    """A :class:`Schema` from parsed YAML/JSON (a user's file, or one stored with a dataset or
    a model), every field checked: one :class:`~torchrec_cloud.untrusted.UntrustedInputError`
    naming the first bad one."""
    d = Fields(raw, where)
    _keys(d, {"format", "name", "label", "dense", "sparse", "split", "delimiter", "header", "columns"})
    name = _ident(d, "name", "schema")
    label = _label(d.obj("label"))
    dense, bucketized = [], []
    for i, raw_item in enumerate(_or(d, "dense", [], lambda k: d.list(k, 4096))):
        item = d.at(f"dense[{i}]", raw_item)
        _keys(item, {"name", "column", "transform", "fill", "buckets", "keep_dense", "boundaries"})
        n = _ident(item, "name")
        column = _or(item, "column", n, lambda k: item.text(k, 200))
        transform = _or(item, "transform", "none", lambda k: item.text(k, choices=TRANSFORMS + ("bucketize",)))
        if transform == "bucketize":
            transform = _bucketize(item, n, column, bucketized)
            if transform is None:
                continue
        else:
            for key in ("buckets", "keep_dense", "boundaries"):
                if item.has(key):
                    raise UntrustedInputError(where, item.field(key), "applies to transform: bucketize only")
        fill = item.data.get("fill", "mean" if transform == "standardize" else 0.0)
        if fill != "mean":
            fill = number(fill, where, item.field("fill"))
        dense.append(Dense(n, column, transform, fill))
    sparse = []
    for i, raw_item in enumerate(_or(d, "sparse", [], lambda k: d.list(k, 4096))):
        item = d.at(f"sparse[{i}]", raw_item)
        _keys(item, {"name", "column", "type", "list", "mapping", "num_embeddings", "min_count", "pooling", "separator",
                     "max_length", "evict_after", "boundaries"})  # fmt: skip
        n = _ident(item, "name")
        mapping = _or(item, "mapping", "hash", lambda k: item.text(k, choices=MAPPINGS))
        numeric = mapping == "bucketize"
        kind = _or(item, "type", "number" if numeric else "string",
                   lambda k: item.text(k, choices=("number",) if numeric else ID_TYPES))  # fmt: skip
        is_list = _or(item, "list", False, item.bool)
        if mapping == "modulo" and kind != "int":
            raise UntrustedInputError(where, item.field("mapping"), "modulo needs integer ids (type: int); use hash or vocab")
        if numeric and is_list:
            raise UntrustedInputError(where, item.field("list"), "bucketize reads one number per row, not a list")
        if item.has("evict_after") and mapping != "vocab":
            raise UntrustedInputError(where, item.field("evict_after"), "applies to mapping: vocab only (other mappings keep no ids)")
        if item.has("boundaries") and not numeric:
            raise UntrustedInputError(where, item.field("boundaries"), "applies to mapping: bucketize only")
        sparse.append(Sparse(
            n, _or(item, "column", n, lambda k: item.text(k, 200)), kind, is_list, mapping,
            item.int("num_embeddings", lo=3 if numeric else 2 if mapping == "vocab" else 1,
                     hi=MAX_BUCKETS + 1 if numeric else MAX_TABLE_ROWS),
            _or(item, "min_count", 1, lambda k: item.int(k, lo=1, hi=1 << 62)),
            _or(item, "pooling", "sum", lambda k: item.text(k, choices=POOLINGS)),
            _or(item, "separator", "|", lambda k: item.text(k, 8)),
            item.int("max_length", lo=1, hi=1 << 20, optional=True),
            item.int("evict_after", lo=1, hi=1 << 20, optional=True),
            _boundaries(item, "quantiles") if numeric else None,
        ))  # fmt: skip
    sparse += bucketized  # a bucketized dense feature's table comes after the id features
    if not dense:
        raise UntrustedInputError(where, "dense", "needs at least one dense feature (the DLRM's bottom MLP reads them; "
                                  "a bucketized one with keep_dense: true counts)")  # fmt: skip
    if not sparse:
        raise UntrustedInputError(where, "sparse", "needs at least one sparse feature (an id column, or a bucketized number)")
    for kind, features in (("dense", dense), ("sparse", sparse)):
        names = [f.name for f in features]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            also = " (a bucketized dense feature is also a sparse feature of its name)" if kind == "sparse" else ""
            raise UntrustedInputError(where, kind, f"the name {dup} is used twice{also}")
    split = None
    s = d.obj("split", optional=True)
    if s is not None:
        _keys(s, {"by", "val_from", "test_from"})
        split = Split(s.text("by"), _bound(s, "val_from"), _bound(s, "test_from"))
    delimiter = d.data.get("delimiter")
    if delimiter is not None and (not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in "\n\r\""):
        raise UntrustedInputError(where, "delimiter", f"must be one character, got {shown(delimiter)}")
    header = _or(d, "header", True, d.bool)
    columns = None
    if d.has("columns"):
        columns = tuple(text(c, where, f"columns[{i}]") for i, c in enumerate(d.list("columns", 100_000)))
    if not header and columns is None:
        raise UntrustedInputError(where, "columns", "a file without a header (header: false) needs its columns named here")
    return Schema(name, label, tuple(dense), tuple(sparse), split, delimiter, header, columns)


def _label(lab: Fields) -> Label:
    _keys(lab, {"column", "threshold", "positive"})
    column, threshold = lab.text("column"), lab.number("threshold", optional=True)
    if not lab.has("positive"):
        return Label(column, threshold)
    if threshold is not None:
        raise UntrustedInputError(lab.file, lab.field("positive"), "give threshold or positive, not both")
    values = lab.list("positive", MAX_POSITIVE)
    if not values:
        raise UntrustedInputError(lab.file, lab.field("positive"), "needs at least one value that counts as 1")
    out: list[Union[str, int, float]] = []
    for i, v in enumerate(values):
        if isinstance(v, str):
            out.append(text(v, lab.file, f"{lab.field('positive')}[{i}]", 200))
        elif type(v) in (int, float):
            out.append(v if type(v) is int else number(v, lab.file, f"{lab.field('positive')}[{i}]"))
        else:
            raise UntrustedInputError(lab.file, f"{lab.field('positive')}[{i}]",
                                      f"must be text or a number (quote it in the YAML), got {shown(v)}")  # fmt: skip
    return Label(column, None, tuple(out))


def _bucketize(item: Fields, name: str, column: str, bucketized: list) -> Optional[str]:
    """A dense feature's ``transform: bucketize``: its bucket as a sparse feature (appended to
    ``bucketized``); the transform of the value kept as a dense input (``keep_dense``), or None."""
    buckets = _or(item, "buckets", DEFAULT_BUCKETS, lambda k: item.int(k, lo=2, hi=MAX_BUCKETS))
    keep = item.data.get("keep_dense", False)
    if keep is True:
        keep = "standardize"
    elif keep is False or keep is None:
        keep = None
    elif not isinstance(keep, str) or keep not in TRANSFORMS:
        raise UntrustedInputError(item.file, item.field("keep_dense"),
                                  f"must be true, false or a transform for the kept value ({', '.join(TRANSFORMS)}), "
                                  f"got {shown(keep)}")  # fmt: skip
    if keep is None and item.has("fill"):
        raise UntrustedInputError(item.file, item.field("fill"), "a missing value has a bucket of its own; fill applies "
                                  "to the value kept with keep_dense")  # fmt: skip
    bucketized.append(Sparse(name, column, "number", False, "bucketize", buckets + 1, boundaries=_boundaries(item, "label")))
    return keep


def _boundaries(item: Fields, default: str) -> Optional[str]:
    """A bucketized feature's ``boundaries``, as :class:`Sparse` keeps it (quantiles: None).
    A sparse ``mapping: bucketize`` without the key is quantiles: what a schema stored before
    the key existed (a manifest, a model folder) was built with."""
    chosen = _or(item, "boundaries", default, lambda k: item.text(k, choices=BOUNDARIES))
    return None if chosen == "quantiles" else chosen


def _bound(s: Fields, key: str) -> Any:
    value = s.get(key)
    if isinstance(value, datetime.date):  # YAML reads an unquoted 2024-03-01 as a date: the same bound as quoted
        return value.isoformat()
    if isinstance(value, str):
        return s.text(key, 200)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value if isinstance(value, int) else s.number(key)
    raise UntrustedInputError(s.file, s.field(key), f"must be a number, a date or a file name, got {shown(value)}")


def split_from_flags(schema: Schema, by: Optional[str], val_from: Optional[str], test_from: Optional[str]) -> Optional[Split]:
    """The split ``--split_by/--val_from/--test_from`` give (numbers given as text become
    numbers), else the schema's own ``split``; None: 80/10/10 by a hash of each row."""
    from torchrec_cloud.config import ConfigError

    if by is None:
        if val_from is not None or test_from is not None:
            raise ConfigError("split_by", "--val_from and --test_from need --split_by COLUMN (or input, or hash:COLUMN)")
        return schema.split
    if val_from is None or test_from is None:
        raise ConfigError("val_from" if val_from is None else "test_from", f"--split_by {by} needs --val_from and --test_from")
    return Split(by, _number_or_text(val_from), _number_or_text(test_from))


def _number_or_text(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value

