"""Parquet and CSV/TSV inputs, local or in a bucket, read as Arrow tables of the columns a
schema names, a batch of rows at a time (pyarrow; plain or ``.gz`` CSV)::

    for first_row, table in Input(path, schema).batches(): ...     # first_row: 0-based

Files whose columns disagree with the schema (a column missing, a Parquet column of the
wrong type) stop with one line naming the file and the column; a CSV row with the wrong
number of fields is a bad row at ``FILE:LINE``. Every value of a CSV is read as text and
converted by :mod:`~torchrec_cloud.data.transforms`, which names the row and column of a
value that does not convert. Input is bounded: a CSV line may be at most
:data:`~torchrec_cloud.untrusted.MAX_LINE_BYTES` (1 MiB, as for every text input), which is
pyarrow's CSV ``block_size`` here: its streaming reader holds a block or two at a time and
refuses a row that straddles blocks, so a file without newlines (or a gzip bomb of one line)
stops after a block rather than filling memory.

Parquet is bounded by what it decodes to, not by its encoded size (a run-length encoded list
of 10^7 zeros is a few KB on disk): before a row group is read, each column it reads may hold
at most :data:`MAX_GROUP_VALUES` values and :data:`MAX_GROUP_COLUMN_BYTES` bytes once
decompressed (its footer says so; a file over them is refused, naming the row group and the
column); text columns of single ids are read as dictionaries (each distinct id once); and
rows are read :data:`BATCH_ROWS` at a time, fewer where the row group's lists are long. Then
every batch, of either format, is checked against :class:`Caps` from the Arrow arrays'
offsets, before any Python object is made of it: a row whose list holds more than ``max_list_length`` ids, or a
text value longer than ``max_id_bytes``, is a bad row (``FILE:ROW``, the column and the cap),
left out of the batch and listed in :attr:`Input.bad_lines` like a CSV row with the wrong
number of fields. docs/data.md states what this bounds a worker's memory to.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import bisect
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from torchrec_cloud import storage
from torchrec_cloud.data.criteo_parse import BadLineError, PreprocessError
from torchrec_cloud.data.schema import Schema
from torchrec_cloud.untrusted import MAX_LINE_BYTES, shown

BATCH_ROWS = 65_536
MAX_ROW_GROUP_BYTES = 2 << 30
MAX_GROUP_VALUES = 1 << 25
"""Values (a list's ids count one each) one column of a Parquet row group may hold: 256 MiB
as int64, decoded before a row over a cap can be seen."""
MAX_GROUP_COLUMN_BYTES = 256 << 20
"""Bytes one column of a Parquet row group may take decompressed."""
BATCH_VALUES = 1 << 22
"""Values of one column that a Parquet batch aims at: rows per batch are cut below
``BATCH_ROWS`` where a row group's lists are long."""
PARQUET = (".parquet", ".pq", ".parq")
CSV = (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".txt.gz")
# What a CSV cell means by "missing" (pyarrow's default list), for every column.
NULLS = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "N/A", "NA",
         "NULL", "NaN", "n/a", "nan", "null"]  # fmt: skip


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


@dataclass(frozen=True)
class Caps:
    """What one row may hold once decoded, whatever its encoding: a row over a cap is bad."""

    max_list_length: int = 100_000
    """Ids in one row's list (``--max_list_length``)."""
    max_id_bytes: int = 4096
    """Bytes of one text value: an id, a list's id, a split key, a label (``--max_id_bytes``);
    a list written as one text cell may take ``max_list_length`` such ids."""

    def check(self) -> "Caps":
        from torchrec_cloud.config import ConfigError

        for flag, value in (("max_list_length", self.max_list_length), ("max_id_bytes", self.max_id_bytes)):
            if type(value) is not int or not 1 <= value <= 1 << 30:
                raise ConfigError(flag, f"must be an integer in 1..{1 << 30}, got {value!r}")
        return self


class BadRowError(BadLineError):
    """A row that cannot be converted; the message starts with ``FILE:LINE:`` (CSV) or
    ``FILE:ROW:`` (Parquet, 1-based) and names the column."""


def kind(path: str) -> str:
    """``parquet`` or ``csv``, by the file's extension."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith(PARQUET):
        return "parquet"
    if name.endswith(CSV):
        return "csv"
    raise PreprocessError(f"{path}: not a Parquet (.parquet) or CSV/TSV (.csv, .tsv, .txt, optionally .gz) file")


def expand(inputs: list[str]) -> list[str]:
    """``inputs`` with each folder (or bucket prefix) replaced by the Parquet and CSV files
    under it, sorted (a partitioned table's ``date=.../part-0.parquet`` files included)."""
    out: list[str] = []
    for path in inputs:
        fs, inner = storage.filesystem(path)
        try:
            is_dir = fs.isdir(inner)
        except Exception as e:  # noqa: BLE001 - storage errors are named by storage.size below
            raise storage.StorageError(path, f"cannot list it ({e})") from e
        if not is_dir:
            storage.size(path)  # a missing file is one line naming it, here
            out.append(path)
            continue
        found = sorted(p for p in fs.find(inner) if p.lower().endswith(PARQUET + CSV))
        if not found:
            raise PreprocessError(f"{path}: a folder with no .parquet, .csv or .tsv file in it")
        scheme = storage.scheme(path)
        out += [f"{scheme}://{p}" if scheme else p for p in found]
    return out


class Input:
    """One input file, read as Arrow tables of the schema's columns."""

    def __init__(self, path: str, schema: Schema, columns: Optional[list[str]] = None, batch_rows: int = BATCH_ROWS,
                 caps: Optional[Caps] = None, split_column: Optional[str] = None):  # fmt: skip
        self.path, self.schema = path, schema
        self.kind = kind(path)
        self.columns = columns if columns is not None else schema.columns_read()
        self.batch_rows = batch_rows
        self.caps = caps or Caps()
        self.split_column = split_column  # a column the split reads: one value per row, not a list
        self._skipped_lines: list[int] = []  # lines (CSV) or rows (Parquet) left out: empty, wrong field count, over a cap
        self.bad_lines: list[tuple[int, str]] = []  # (line or row, reason) of rows left out as bad, in file order

    # -- where a row is ------------------------------------------------------------------

    def where(self, row: int) -> str:
        """``FILE:LINE`` of data row ``row`` (0-based, among the rows given out: those left out
        as bad are counted back in) of a CSV, or ``FILE:ROW`` (1-based) of a Parquet file."""
        line = row + 1 + (1 if self.kind == "csv" and self.schema.header else 0)
        for skipped in self._skipped_lines:  # sorted: lines the reader dropped before this one
            if skipped <= line:
                line += 1
            else:
                break
        return f"{self.path}:{line}"

    # -- reading --------------------------------------------------------------------------

    def available(self) -> list[str]:
        """The file's column names (a CSV's header, or the schema's ``columns``); a name
        given twice is an error (which of the two would be read?)."""
        if self.kind == "parquet":
            with storage.open(self.path, "rb") as f:
                return _unique(self.path, list(self.parquet_file(f).schema_arrow.names))
        if not self.schema.header:
            return _unique(self.path, list(self.schema.columns or []))
        first = b""
        with self._open() as f:
            while b"\n" not in first and len(first) <= MAX_LINE_BYTES:
                block = f.read(1 << 16)
                if not block:
                    break
                first += block
        first = first.split(b"\n", 1)[0]
        if len(first) > MAX_LINE_BYTES:
            raise PreprocessError(f"{self.path}:1: the header line is longer than {MAX_LINE_BYTES} bytes")
        try:
            header = first.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise PreprocessError(f"{self.path}:1: the header is not UTF-8 text") from None
        import csv

        return _unique(f"{self.path}:1", next(csv.reader([header.rstrip("\r")], delimiter=self._parse_options().delimiter), []))

    def parquet_file(self, f: Any, **kwargs: Any) -> pq.ParquetFile:
        """``f`` opened as Parquet: a file that is not one (empty, another format, a damaged
        footer) is one line naming it."""
        try:
            return pq.ParquetFile(f, **kwargs)
        except (pa.ArrowException, OSError, ValueError, IndexError) as e:
            raise PreprocessError(f"{self.path}: not a readable Parquet file ({shown(str(e), 200)})") from None

    def check_columns(self) -> None:
        """Stop, naming the file and column, where the file lacks a column the schema reads."""
        names = self.available()
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise PreprocessError(
                f"{self.path}: column {shown(missing[0])} named in the schema is not in the file "
                f"(it has: {shown(', '.join(names), 300)})"
            )

    def check_types(self) -> None:
        """A Parquet file's columns must hold what the schema reads from them (a CSV's are text,
        checked value by value): stop naming the file and the first column that does not."""
        if self.kind != "parquet":
            return
        with storage.open(self.path, "rb") as f:
            types = {field.name: field.type for field in self.parquet_file(f).schema_arrow}
        for column, role, ok in self._roles():
            t = types.get(column)
            if t is not None and column in self.columns and not ok(_plain(t)):
                raise PreprocessError(f"{self.path}: column {shown(column)} holds {t}, but the schema reads it as {role}; "
                                      "fix the schema or the file")  # fmt: skip

    def _roles(self) -> list[tuple[str, str, Any]]:
        number = lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)  # noqa: E731
        text = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)  # noqa: E731
        if self.schema.label.positive is None:
            out = [(self.schema.label.column, "the label (numbers)", number)]
        else:
            out = [(self.schema.label.column, "the label (text or numbers)", lambda t: text(t) or number(t))]
        out += [(f.column, f"dense feature {f.name} (numbers)", number) for f in self.schema.dense]
        for f in self.schema.sparse:
            if f.mapping == "bucketize":
                out.append((f.column, f"bucketized feature {f.name} (numbers)", number))
                continue
            ids = pa.types.is_integer if f.type == "int" else (lambda t: text(t) or pa.types.is_integer(t))
            if f.list:
                out.append((f.column, f"list feature {f.name} (lists of {f.type} ids, or text split at {f.separator!r})",
                            lambda t, ids=ids: text(t) or (_is_list(t) and ids(_plain(t.value_type)))))  # fmt: skip
            else:
                out.append((f.column, f"sparse feature {f.name} ({f.type} ids)", ids))
        if self.split_column:
            out.append((self.split_column, "the split's key (one value per row)",
                        lambda t: not (_is_list(t) or pa.types.is_struct(t) or pa.types.is_map(t))))  # fmt: skip
        return out

    def batches(self) -> Iterator[tuple[int, pa.Table]]:
        """``(first row, table)`` of every batch of rows, in file order."""
        self.check_columns()
        self.check_types()
        if self.kind == "parquet":
            yield from self._parquet()
        else:
            yield from self._csv()

    def _parquet(self) -> Iterator[tuple[int, pa.Table]]:
        with storage.open(self.path, "rb") as f:
            meta = self.parquet_file(f).metadata
            text_ids = self._text_id_columns(meta)
            pf = self.parquet_file(f, read_dictionary=text_ids) if text_ids else self.parquet_file(f)
            batch_rows = self._check_row_groups(meta)
            row = 0  # rows read, bad ones included
            kept = 0  # rows yielded
            try:
                for batch in pf.iter_batches(batch_size=batch_rows, columns=self.columns, use_threads=False):
                    table = self._capped(pa.Table.from_batches([batch]), lambda r, row=row: row + r + 1)
                    row += batch.num_rows
                    if table.num_rows:
                        yield kept, table
                        kept += table.num_rows
            except (pa.ArrowException, OSError) as e:
                raise PreprocessError(f"{self.path}: cannot read rows after row {row} ({shown(str(e), 200)})") from None

    def _leaves(self, meta: Any) -> dict[str, list[int]]:
        """The Parquet leaf columns of each column read (a list column has one leaf)."""
        paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
        return {c: [i for i, p in enumerate(paths) if p == c or p.startswith(c + ".")] for c in self.columns}

    def _text_id_columns(self, meta: Any) -> list[str]:
        """The text columns of single ids, read as dictionaries: a crafted row group whose rows
        all point at one long dictionary entry decodes to one copy of it, not one a row.
        (pyarrow's batches cannot keep a list's text as a dictionary.)"""
        singles = {f.column for f in self.schema.sparse if not f.list}
        leaves = self._leaves(meta)
        return [c for c in self.columns if c in singles and len(leaves[c]) == 1 and meta.schema.column(leaves[c][0]).path == c
                and meta.schema.column(leaves[c][0]).physical_type == "BYTE_ARRAY"]  # fmt: skip

    def _check_row_groups(self, meta: Any) -> int:
        """Refuse a row group that decodes to more than the caps; the rows to read at a time."""
        leaves = self._leaves(meta)
        batch_rows = self.batch_rows
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            size = group.total_byte_size
            if size > MAX_ROW_GROUP_BYTES:
                raise PreprocessError(f"{self.path}: row group {g} holds {size} bytes, more than the "
                                      f"{MAX_ROW_GROUP_BYTES} read at once; write it with smaller row groups")  # fmt: skip
            for column, indices in leaves.items():
                for i in indices:
                    chunk = group.column(i)
                    for what, got, cap in (("values", chunk.num_values, MAX_GROUP_VALUES),
                                           ("bytes decompressed", chunk.total_uncompressed_size, MAX_GROUP_COLUMN_BYTES)):  # fmt: skip
                        if got > cap:
                            raise PreprocessError(
                                f"{self.path}: row group {g}, column {shown(column)}: {got} {what}, more than the {cap} "
                                f"decoded at once; write it with smaller row groups")  # fmt: skip
                    if group.num_rows and chunk.num_values > group.num_rows:  # lists: fewer rows a batch
                        batch_rows = min(batch_rows, max(1, BATCH_VALUES * group.num_rows // chunk.num_values))
        return batch_rows

    def _capped(self, table: pa.Table, number: Any) -> pa.Table:
        """``table`` without its rows over the caps, which are listed in ``bad_lines`` by
        ``number(r)``, the line (CSV) or row (Parquet) number of the table's row ``r``."""
        over = np.zeros(table.num_rows, bool)
        reasons: dict[int, str] = {}
        lists = {f.column for f in self.schema.sparse if f.list}
        for name in table.column_names:
            for rows, why in _over_caps(_chunks(table.column(name)), self.caps, name in lists):
                for k, r in enumerate(rows):
                    if not over[r]:
                        reasons[int(r)] = f"column {shown(name)}: {why(k)}"
                over[rows] = True
        if not over.any():
            return table
        numbers = {int(r): number(int(r)) for r in np.flatnonzero(over)}  # all before any is left out
        for r, n in numbers.items():
            bisect.insort(self._skipped_lines, n)
            bisect.insort(self.bad_lines, (n, reasons[r]))
        return table.filter(pa.array(~over))

    def _open(self) -> Any:
        raw = storage.open(self.path, "rb")
        if self.path.endswith(".gz"):
            return pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "gzip")
        return raw

    def _parse_options(self, handler: Any = None) -> pcsv.ParseOptions:
        delimiter = self.schema.delimiter or ("\t" if self.path.removesuffix(".gz").endswith((".tsv", ".txt")) else ",")
        return pcsv.ParseOptions(delimiter=delimiter, invalid_row_handler=handler, ignore_empty_lines=False)

    def _csv(self) -> Iterator[tuple[int, pa.Table]]:
        def invalid(row: Any) -> str:
            # An empty line is skipped silently (a file's trailing blank line); a row with
            # another number of fields is a bad row. Lines are counted either way, so
            # every other row keeps its line number.
            self._skipped_lines.append(int(row.number))
            if row.text:
                self.bad_lines.append((int(row.number), f"expected {row.expected_columns} fields, found {row.actual_columns}"))
            return "skip"

        names = None if self.schema.header else list(self.schema.columns or [])
        read = pcsv.ReadOptions(block_size=MAX_LINE_BYTES, use_threads=False, column_names=names,
                                autogenerate_column_names=False)  # fmt: skip
        convert = pcsv.ConvertOptions(column_types={c: pa.string() for c in self.columns}, include_columns=self.columns,
                                      null_values=NULLS, strings_can_be_null=True, quoted_strings_can_be_null=False)  # fmt: skip
        row = 0  # rows yielded

        def capped(table: pa.Table) -> pa.Table:
            return self._capped(table, lambda r: int(self.where(row + r).rsplit(":", 1)[1]))

        with self._open() as f:
            try:
                reader = pcsv.open_csv(f, read_options=read, parse_options=self._parse_options(invalid), convert_options=convert)
                pending: list[pa.RecordBatch] = []
                pending_rows = 0
                for batch in reader:
                    pending.append(batch)
                    pending_rows += batch.num_rows
                    if pending_rows >= self.batch_rows:
                        table = capped(pa.Table.from_batches(pending))
                        yield row, table
                        row += table.num_rows
                        pending, pending_rows = [], 0
                if pending_rows:
                    yield row, capped(pa.Table.from_batches(pending))
            except pa.ArrowInvalid as e:
                text = str(e)
                if "straddling" in text or "block" in text:
                    raise PreprocessError(f"{self.path}: a line after row {row} is longer than {MAX_LINE_BYTES} bytes "
                                          "(or a quote is never closed)") from None  # fmt: skip
                raise PreprocessError(f"{self.path}: cannot read it as CSV after row {row} ({shown(text, 200)})") from None
            except (EOFError, OSError) as e:
                raise PreprocessError(f"{self.path}: cannot read it ({shown(str(e), 200)})") from None


def _unique(where: str, names: list[str]) -> list[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise PreprocessError(f"{where}: the column name {shown(name)} is given twice; rename one of them")
        seen.add(name)
    return names


def _chunks(column: Any) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _byte_lengths(arr: pa.Array) -> Optional[np.ndarray]:
    """Each value's bytes (0 where missing) of a text or binary array, a dictionary's read
    from its dictionary; None for other types."""
    if pa.types.is_dictionary(arr.type):
        lengths = _byte_lengths(arr.dictionary)
        if lengths is None:
            return None
        index = pc.fill_null(arr.indices, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.where(arr.is_null().to_numpy(zero_copy_only=False), 0, lengths[index]) if len(lengths) else np.zeros(len(arr), np.int64)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) or pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return None


def _over_caps(arr: pa.Array, caps: Caps, text_list: bool) -> list[tuple[np.ndarray, Any]]:
    """Rows of ``arr`` over a cap, and why (of the k-th of them), from its offsets and lengths only."""
    out = []
    if _is_list(arr.type):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(lengths > caps.max_list_length)
        if len(rows):
            out.append((rows, lambda k, rows=rows: f"a list of {int(lengths[rows[k]])} ids, more than --max_list_length {caps.max_list_length}"))
        element = _byte_lengths(pc.list_flatten(arr))
        if element is not None and len(element):
            long = np.flatnonzero(element > caps.max_id_bytes)
            if len(long):
                parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)[long]
                rows, first = np.unique(parents, return_index=True)
                out.append((rows, lambda k: f"an id of {int(element[long[first[k]]])} bytes in its list, more than "
                            f"--max_id_bytes {caps.max_id_bytes}"))  # fmt: skip
        return out
    lengths = _byte_lengths(arr)
    if lengths is not None:
        cap = caps.max_list_length * (caps.max_id_bytes + 1) if text_list else caps.max_id_bytes
        rows = np.flatnonzero(lengths > cap)
        if len(rows):
            flag = "--max_list_length x (--max_id_bytes + 1)" if text_list else "--max_id_bytes"
            out.append((rows, lambda k: f"a value of {int(lengths[rows[k]])} bytes, more than {flag} {cap}"))
    return out
