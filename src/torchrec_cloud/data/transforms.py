"""Raw rows to model inputs: the one conversion that preprocessing writes into shards and that
``predict`` applies to raw rows, so a score never sees another transform than training did::

    t = Transforms(schema, vocabularies, dense_stats, boundaries)
    encoded = t.encode(table, source)          # table: pyarrow rows of the schema's columns
    encoded.records["dense"], encoded.lists[0] # float32 [B, D]; (offsets, ids) of a list feature

- Label: a 0/1 (or true/false) column, ``value >= threshold`` of a numeric one, or 1 where
  the value is one of ``positive`` (text equal to a text value, or a number equal to a
  numeric one; a number written as text in a CSV compares as its number) and 0 otherwise.
- Dense: a missing value (empty, null, NaN) gets ``fill`` (a number, or the training rows'
  mean), then ``none``, ``log1p`` (``log(1 + max(x, 0))``) or ``standardize`` (``(x - mean) /
  std``, with the training rows' statistics), as float32. A value that is not finite then
  (``inf`` in the file, or one that overflows float32) makes its row bad.
- Sparse ids to table rows: ``hash`` (strings: XXH3-64 of the UTF-8 bytes; integers:
  splitmix64 of the value; modulo the table size), ``vocab`` (row 1 + the id's rank by count
  among training ids seen at least ``min_count`` times; row 0 for every other id, seen or
  not) or ``modulo`` (an integer id modulo the table size). A missing single id is -1 in a
  record (no id: an empty bag); a list's missing entries are dropped.
- A bucketized number (``mapping: bucketize``) to its bucket's row
  (:func:`~torchrec_cloud.data.buckets.bucket_rows` with the training rows' boundaries): row 0
  for a missing value, else 1 + the number of boundaries at or below it.

A value that does not convert (text in a numeric column, a missing or non-0/1 label, a
missing split key) makes its row bad: :meth:`Transforms.encode` lists bad rows with the
column and the reason, and the caller stops at ``FILE:LINE`` or skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from torchrec_cloud.data.buckets import bucket_rows
from torchrec_cloud.data.schema import Schema, Sparse, Split
from torchrec_cloud.untrusted import shown

SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
INT32_MAX = 2**31 - 1
DEFAULT_SPLIT = Split("hash:", 0.8, 0.9)  # no split given: 80/10/10 by a hash of each row
_NUMBER = r"^\s*[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?)\s*$"
_INTEGER = r"^\s*[-+]?\d{1,18}\s*$"
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of int64 values, as uint64 (the stable hash of integer ids)."""
    z = x.astype(np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_strings(values: Sequence[str], seed: int = 0) -> np.ndarray:
    """XXH3-64 of each string's UTF-8 bytes, as uint64 (the stable hash of string ids)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(v.encode("utf-8"), seed) for v in values), np.uint64, len(values))


def id_dtype(num_embeddings: Sequence[int]) -> str:
    """The stored id type: int32 when every table fits it."""
    return "int32" if max(num_embeddings, default=1) <= INT32_MAX else "int64"


def record_dtype(schema: Schema, table_sizes: Sequence[int]) -> np.dtype:
    """One stored row: label int32, the dense features float32, the single-valued ids."""
    singles = [n for f, n in zip(schema.sparse, table_sizes) if not f.list]
    ids = "<i4" if id_dtype(singles) == "int32" else "<i8"
    return np.dtype([("label", "<i4"), ("dense", "<f4", (len(schema.dense),)), ("sparse", ids, (len(singles),))])


@dataclass
class Encoded:
    """Rows of one batch, converted: records, list features, splits, and the bad rows left out."""

    records: np.ndarray
    lists: list[tuple[np.ndarray, np.ndarray]]  # per list feature: offsets int64 [n + 1], ids
    split: np.ndarray  # int8 per kept row: 0 train, 1 val, 2 test
    kept: np.ndarray  # row index (in the batch) of each record
    bad: dict[int, str] = field(default_factory=dict)  # batch row -> "column: reason" (the first few)
    bad_count: int = 0


class _Column:
    """One column converted: values (numpy or Arrow) and the rows whose value is bad."""

    def __init__(self, values: Any, bad: np.ndarray, reason: Any) -> None:
        self.values, self.bad, self.reason = values, bad, reason


def _texts(column: pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _numbers(column: Any, name: str) -> _Column:
    """float64 values (NaN where missing); text that is not a number is bad."""
    arr = _texts(column)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_boolean(arr.type) or pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type):
        values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
        return _Column(np.where(np.isnan(values), np.nan, values), np.zeros(len(values), bool), None)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        try:  # clean text converts at once; only a column with a bad value is checked value by value
            values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
            return _Column(values, np.zeros(len(values), bool), None)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        ok = pc.fill_null(pc.match_substring_regex(arr, _NUMBER, ignore_case=True), True).to_numpy(zero_copy_only=False)
        clean = pc.if_else(pa.array(ok), arr, pa.scalar(None, arr.type))
        values = pc.cast(pc.utf8_trim_whitespace(clean), pa.float64()).to_numpy(zero_copy_only=False)
        return _Column(values, ~ok, lambda i: f"column {name}: not a number: {shown(repr(arr[i].as_py()))}")
    return _Column(None, np.ones(len(arr), bool), lambda i: f"column {name} holds {arr.type}, not numbers")


def _not_finite(col: _Column, infinite: np.ndarray, name: str, transform: str) -> _Column:
    """``col`` with the rows in ``infinite`` bad too."""
    before = col.reason

    def reason(i: int) -> str:
        if infinite[i]:
            return f"column {shown(name)}: {float(col.values[i]):g} is not a finite number after its transform ({transform})"
        return before(i)

    return _Column(col.values, col.bad | infinite, reason)


def _label(column: Any, schema: Schema) -> _Column:
    name, threshold = schema.label.column, schema.label.threshold
    if schema.label.positive is not None:
        return _label_of_values(column, name, schema.label.positive)
    arr = _texts(column)
    if threshold is None and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        lowered = pc.utf8_lower(arr)
        arr = pc.if_else(pc.equal(lowered, "true"), "1", pc.if_else(pc.equal(lowered, "false"), "0", arr))
    col = _numbers(arr, name)
    if col.values is None:
        return col
    v = col.values
    missing = np.isnan(v) & ~col.bad
    if threshold is None:
        wrong = ~np.isnan(v) & (v != 0) & (v != 1)
        labels = (v == 1).astype(np.int32)
    else:
        wrong = np.zeros(len(v), bool)
        labels = (v >= threshold).astype(np.int32)
    text_reason = col.reason

    def reason(i: int) -> str:
        if missing[i]:
            return f"column {name}: the label is missing"
        if wrong[i]:
            return f"column {name}: the label must be 0 or 1 (or give the schema a threshold), got {shown(repr(arr[i].as_py()))}"
        return text_reason(i)

    return _Column(labels, col.bad | missing | wrong, reason)


def int_ids(values: pa.Array, f: Sparse) -> tuple[pa.Array, np.ndarray, Any]:
    """Integer ids of ``values`` (text like `` 5`` or ``+7`` too) as int64, null where missing
    or bad; the bad entries and why. Counting and encoding both read ids through it, so a
    vocabulary holds the ids the encoder looks up."""
    bad = np.zeros(len(values), bool)
    reason = None
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        try:  # clean text converts at once
            values = pc.cast(values, pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            ok = pc.fill_null(pc.match_substring_regex(values, _INTEGER), True).to_numpy(zero_copy_only=False)
            bad = ~ok
            shown_values = values
            reason = lambda i: f"column {shown(f.column)}: not an integer id: {shown(repr(shown_values[i].as_py()))}"  # noqa: E731
            clean = pc.utf8_trim_whitespace(pc.if_else(pa.array(ok), values, pa.scalar(None, values.type)))
            values = pc.cast(pc.replace_substring_regex(clean, r"^\+", ""), pa.int64())
    elif pa.types.is_floating(values.type):
        as_int = pc.cast(values, pa.int64(), safe=False)
        whole = pc.fill_null(pc.equal(pc.cast(as_int, values.type), values), True).to_numpy(zero_copy_only=False)
        bad = ~whole
        shown_values = values
        reason = lambda i: f"column {shown(f.column)}: not an integer id: {shown(repr(shown_values[i].as_py()))}"  # noqa: E731
        values = pc.if_else(pa.array(whole), as_int, pa.scalar(None, pa.int64()))
    elif not pa.types.is_integer(values.type):
        raise TypeError(f"column {shown(f.column)} holds {values.type}, not integer ids")
    return pc.cast(values, pa.int64()), bad, reason


def _label_of_values(column: Any, name: str, positive: Sequence[Any]) -> _Column:
    """1 where the value is one of ``positive``, 0 for every other value present; a missing
    value is a bad row."""
    arr = _texts(column)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    texts = [v for v in positive if isinstance(v, str)]
    numbers = [float(v) for v in positive if not isinstance(v, str)]
    missing = pc.is_null(arr).to_numpy(zero_copy_only=False)
    hit = np.zeros(len(arr), bool)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        if texts:
            hit |= pc.fill_null(pc.is_in(arr, pa.array(texts, arr.type)), False).to_numpy(zero_copy_only=False)
        as_numbers = _numbers_or_null(arr)
    elif pa.types.is_boolean(arr.type) or pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type):
        as_numbers = pc.cast(arr, pa.float64())
        numbers += [float(v) for v in texts if _is_number_text(v)]  # a number written as text in the schema
    else:
        return _Column(None, np.ones(len(arr), bool), lambda i: f"column {name} holds {arr.type}, not labels")
    if numbers:
        hit |= pc.fill_null(pc.is_in(as_numbers, pa.array(numbers, pa.float64())), False).to_numpy(zero_copy_only=False)
    return _Column(hit.astype(np.int32), missing, lambda i: f"column {name}: the label is missing")


def _is_number_text(value: str) -> bool:
    try:
        float(value)
        return True
    except ValueError:
        return False


def _ids_of_values(values: pa.Array, f: Sparse, vocab: Optional[dict]) -> tuple[np.ndarray, np.ndarray, Any]:
    """Table rows of flat id ``values`` (-1 where missing), the bad entries, and why."""
    n = len(values)
    bad = np.zeros(n, bool)
    reason = None
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if f.type == "int":
        values, bad, reason = int_ids(values, f)
    else:
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            values = pc.cast(values, pa.string())  # integers become their decimal text
    missing = pc.is_null(values).to_numpy(zero_copy_only=False) | bad
    rows = np.full(n, -1, np.int64)
    if f.mapping == "vocab":
        encoded = pc.dictionary_encode(values)
        uniques = encoded.dictionary.to_pylist()
        mapped = np.fromiter((vocab.get(u, 0) for u in uniques), np.int64, len(uniques))  # type: ignore[union-attr]
        index = encoded.indices.to_numpy(zero_copy_only=False)
        rows[~missing] = mapped[index[~missing].astype(np.int64)]
        return rows, bad, reason
    if f.type == "int":
        raw = pc.fill_null(values, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        if f.mapping == "modulo":
            mapped = np.mod(raw, f.num_embeddings)
        else:
            mapped = (splitmix64(raw) % np.uint64(f.num_embeddings)).astype(np.int64)
        rows[~missing] = mapped[~missing]
        return rows, bad, reason
    encoded = pc.dictionary_encode(values)
    uniques = encoded.dictionary.to_pylist()
    mapped = (hash_strings(uniques) % np.uint64(f.num_embeddings)).astype(np.int64)
    index = encoded.indices.to_numpy(zero_copy_only=False)
    rows[~missing] = mapped[index[~missing].astype(np.int64)]
    return rows, bad, reason


def _list_array(column: Any, f: Sparse) -> pa.Array:
    """A list column as a ListArray (a text column is split at ``separator``)."""
    arr = _texts(column)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return pc.split_pattern(pc.if_else(pc.equal(arr, ""), pa.scalar(None, arr.type), arr), f.separator)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        return pc.cast(arr, pa.list_(arr.type.value_type)) if not pa.types.is_list(arr.type) else arr
    raise TypeError(f"column {f.column} holds {arr.type}, not a list of ids")


class Transforms:
    """A schema with the statistics preprocessing found: vocabularies and dense moments.

    ``vocabularies``: feature name -> its ids in row order (row i + 1); ``dense_stats``:
    feature name -> ``{"mean", "std"}`` (standardize, or a ``mean`` fill); ``boundaries``:
    a bucketized feature's name -> its increasing boundaries (none yet: one bucket). ``table_sizes``:
    the rows of each sparse feature's table (a vocabulary's size plus its row 0)."""

    def __init__(self, schema: Schema, vocabularies: dict[str, list], dense_stats: dict[str, dict[str, float]],
                 boundaries: Optional[dict[str, Sequence[float]]] = None) -> None:  # fmt: skip
        self.schema = schema
        self.boundaries = {name: np.asarray(b, np.float64) for name, b in (boundaries or {}).items()}
        self.vocab = {name: {v: i + 1 for i, v in enumerate(values)} for name, values in vocabularies.items()}
        self.dense_stats = dense_stats
        self.table_sizes = [len(vocabularies[f.name]) + 1 if f.mapping == "vocab" else f.num_embeddings
                            for f in schema.sparse]  # fmt: skip
        self.dtype = record_dtype(schema, self.table_sizes)
        self.list_dtype = np.dtype("<i4" if id_dtype(self.table_sizes) == "int32" else "<i8")
        self._fill, self._scale = [], []
        for f in schema.dense:
            stats = dense_stats.get(f.name, {})
            fill = stats.get("mean", 0.0) if f.fill == "mean" else float(f.fill)
            mean, std = (stats["mean"], stats["std"]) if f.transform == "standardize" else (0.0, 1.0)
            self._fill.append(fill)
            self._scale.append((mean, std))

    def dense(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray, Any]:
        out = np.empty((table.num_rows, len(self.schema.dense)), np.float32)
        bad = np.zeros(table.num_rows, bool)
        reasons = []
        for j, f in enumerate(self.schema.dense):
            col = _numbers(table.column(f.column), f.column)
            if col.values is None:
                raise TypeError(f"column {f.column} holds {table.column(f.column).type}, not numbers")
            x = np.where(np.isnan(col.values), self._fill[j], col.values)
            if f.transform == "log1p":
                x = np.log1p(np.maximum(x, 0.0))
            elif f.transform == "standardize":
                mean, std = self._scale[j]
                x = (x - mean) / std
            out[:, j] = x
            # inf in the file, or a value that overflows float32 after its transform: a model
            # fed one trains to NaN, so the row is bad (a missing value, NaN, got its fill).
            infinite = ~np.isfinite(out[:, j]) & ~col.bad
            if infinite.any():
                col = _not_finite(col, infinite, f.column, f.transform)
            bad |= col.bad
            reasons.append(col)
        return out, bad, lambda i: next(c.reason(i) for c in reasons if c.bad[i])

    def split_of(self, table: pa.Table, split: Optional[Split], source: int, source_name: str, first_row: int,
                 inputs: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Any]:  # fmt: skip
        """Each row's split code, the rows whose split key is missing or bad, and why."""
        n = table.num_rows
        split = split or DEFAULT_SPLIT
        bad = np.zeros(n, bool)
        if split.by == "input":
            position = {p: i for i, p in enumerate(inputs)}
            code = 2 if source >= position[split.test_from] else 1 if source >= position[split.val_from] else 0
            return np.full(n, code, np.int8), bad, None
        if split.by.startswith("hash:"):
            column = split.by[len("hash:") :]
            if column:
                values = _texts(table.column(column))
                missing = pc.is_null(values).to_numpy(zero_copy_only=False)
                if pa.types.is_integer(values.type):
                    h = splitmix64(pc.fill_null(values, 0).to_numpy(zero_copy_only=False) ^ np.int64(0x5EED))
                else:
                    encoded = pc.dictionary_encode(pc.cast(values, pa.string()))
                    h = hash_strings(encoded.dictionary.to_pylist(), seed=0x5EED)[
                        pc.fill_null(encoded.indices, 0).to_numpy(zero_copy_only=False).astype(np.int64)]
            else:  # no key: the row's place in its file
                missing = np.zeros(n, bool)
                salt = xxhash.xxh3_64_intdigest(source_name.encode(), 0x5EED) & 0x7FFFFFFFFFFFFFFF
                h = splitmix64(np.arange(first_row, first_row + n, dtype=np.int64) ^ np.int64(salt))
            u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
            code = np.where(u >= float(split.test_from), 2, np.where(u >= float(split.val_from), 1, 0)).astype(np.int8)
            return code, missing, lambda i: f"column {column}: the split key is missing"
        values = _texts(table.column(split.by))
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        lo, hi = _bound_for(values, split.val_from), _bound_for(values, split.test_from)
        if isinstance(lo, float):
            values = pc.cast(values, pa.float64()) if not pa.types.is_string(values.type) else _numbers_or_null(values)
        missing = pc.is_null(values).to_numpy(zero_copy_only=False)
        ge_test = pc.fill_null(pc.greater_equal(values, hi), False).to_numpy(zero_copy_only=False)
        ge_val = pc.fill_null(pc.greater_equal(values, lo), False).to_numpy(zero_copy_only=False)
        code = np.where(ge_test, 2, np.where(ge_val, 1, 0)).astype(np.int8)
        return code, missing, lambda i: f"column {split.by}: the split value is missing or not comparable"

    def encode(self, table: pa.Table, split: Optional[Split], source: int = 0, source_name: str = "",
               first_row: int = 0, inputs: Sequence[str] = (), labelled: bool = True) -> Encoded:  # fmt: skip
        """Convert one batch of raw rows. ``labelled=False`` (predict on rows without the label
        column) gives label 0 to every row; ``split=False``-like scoring passes ``split=None``
        with ``inputs`` empty and gets every row as "test"."""
        n = table.num_rows
        checks: list[tuple[np.ndarray, Any]] = []
        if labelled:
            label = _label(table.column(self.schema.label.column), self.schema)
            checks.append((label.bad, label.reason))
            labels = label.values if label.values is not None else np.zeros(n, np.int32)
        else:
            labels = np.zeros(n, np.int32)
        dense, dense_bad, dense_reason = self.dense(table)
        checks.append((dense_bad, dense_reason))
        singles, lists = [], []
        for f in self.schema.sparse:
            vocab = self.vocab.get(f.name)
            if f.mapping == "bucketize":
                col = _numbers(table.column(f.column), f.column)
                if col.values is None:
                    raise TypeError(f"column {f.column} holds {table.column(f.column).type}, not numbers")
                singles.append(bucket_rows(col.values, self.boundaries.get(f.name, np.zeros(0))))
                checks.append((col.bad, col.reason))
                continue
            if not f.list:
                rows, bad, reason = _ids_of_values(_texts(table.column(f.column)), f, vocab)
                singles.append(rows)
                checks.append((bad, reason))
                continue
            arr = _list_array(table.column(f.column), f)
            flat = pc.list_flatten(arr)
            parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False).astype(np.int64)
            rows, bad_values, reason = _ids_of_values(flat, f, vocab)
            bad = np.zeros(n, bool)
            if bad_values.any():
                bad[parents[bad_values]] = True
            keep = rows >= 0
            if f.max_length is not None:
                starts = arr.offsets.to_numpy(zero_copy_only=False)[:-1].astype(np.int64) - int(arr.offsets[0].as_py())
                keep &= (np.arange(len(rows)) - starts[parents]) < f.max_length
            lists.append((parents[keep], rows[keep]))
            checks.append((bad, (lambda r, p, b: lambda i: r(int(np.flatnonzero(b & (p == i))[0])))(reason, parents, bad_values)))
        if inputs or split is not None:
            codes, split_bad, split_reason = self.split_of(table, split, source, source_name, first_row, inputs)
            checks.append((split_bad, split_reason))
        else:
            codes = np.full(n, SPLIT_CODES["test"], np.int8)
        bad = np.zeros(n, bool)
        for mask, _ in checks:
            bad |= mask
        reasons = {}
        for i in np.flatnonzero(bad)[:5]:
            reasons[int(i)] = next(r(int(i)) for mask, r in checks if mask[i])
        kept = np.flatnonzero(~bad)
        records = np.zeros(len(kept), self.dtype)
        records["label"] = labels[kept]
        records["dense"] = dense[kept]
        if singles:
            records["sparse"] = np.stack(singles, axis=1)[kept]
        out_lists = []
        if len(kept) < n:
            new_index = np.full(n, -1, np.int64)
            new_index[kept] = np.arange(len(kept))
        for parents, rows in lists:
            if len(kept) < n:
                stays = new_index[parents] >= 0
                parents, rows = new_index[parents[stays]], rows[stays]
            lengths = np.bincount(parents, minlength=len(kept)) if len(parents) else np.zeros(len(kept), np.int64)
            offsets = np.zeros(len(kept) + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            out_lists.append((offsets, rows.astype(self.list_dtype)))
        return Encoded(records, out_lists, codes[kept], kept, reasons, int(bad.sum()))


def _numbers_or_null(values: pa.Array) -> pa.Array:
    ok = pc.fill_null(pc.match_substring_regex(values, _NUMBER, ignore_case=True), False)
    return pc.cast(pc.utf8_trim_whitespace(pc.if_else(ok, values, pa.scalar(None, values.type))), pa.float64())


def _bound_for(values: pa.Array, bound: Any) -> Any:
    """A split bound as a scalar comparable with the column: a number for numbers (and for a
    text column when the bound is a number), a timestamp or date for those, else text."""
    t = values.type
    if isinstance(bound, (int, float)) and not isinstance(bound, bool):
        return float(bound)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        try:
            return float(bound)
        except ValueError:
            raise ValueError(f"the split's bound {shown(repr(bound))} cannot be compared with a column of {t}: give a number") from None
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        text = pa.scalar(str(bound))
        try:
            if pa.types.is_date(t):
                return text.cast(pa.timestamp("s")).cast(t)
            try:
                return text.cast(t)
            except pa.ArrowInvalid:  # no zone offset given: a time in the column's zone
                if t.tz is None:
                    raise
                return pc.assume_timezone(text.cast(pa.timestamp(t.unit)), t.tz)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise ValueError(f"cannot compare {t} with {bound!r}: give an ISO date like 2024-03-01") from None
    return pa.scalar(str(bound), t)
