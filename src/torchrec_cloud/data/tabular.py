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
stops after a block rather than filling memory; a Parquet row group may be at most
``MAX_ROW_GROUP_BYTES``.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from torchrec_cloud import storage
from torchrec_cloud.data.criteo_parse import BadLineError, PreprocessError
from torchrec_cloud.data.schema import Schema
from torchrec_cloud.untrusted import MAX_LINE_BYTES, shown

BATCH_ROWS = 65_536
MAX_ROW_GROUP_BYTES = 2 << 30
PARQUET = (".parquet", ".pq", ".parq")
CSV = (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".txt.gz")
# What a CSV cell means by "missing" (pyarrow's default list), for every column.
NULLS = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "N/A", "NA",
         "NULL", "NaN", "n/a", "nan", "null"]  # fmt: skip


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


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

    def __init__(self, path: str, schema: Schema, columns: Optional[list[str]] = None, batch_rows: int = BATCH_ROWS):
        self.path, self.schema = path, schema
        self.kind = kind(path)
        self.columns = columns if columns is not None else schema.columns_read()
        self.batch_rows = batch_rows
        self._skipped_lines: list[int] = []  # CSV lines the reader left out (empty, or wrong field count)
        self.bad_lines: list[tuple[int, str]] = []  # (line, reason) of rows with the wrong field count

    # -- where a row is ------------------------------------------------------------------

    def where(self, row: int) -> str:
        """``FILE:LINE`` of data row ``row`` (0-based, among the rows read) of a CSV, or
        ``FILE:ROW`` (1-based) of a Parquet file."""
        if self.kind == "parquet":
            return f"{self.path}:{row + 1}"
        line = row + 1 + (1 if self.schema.header else 0)
        for skipped in self._skipped_lines:  # sorted: lines the reader dropped before this one
            if skipped <= line:
                line += 1
            else:
                break
        return f"{self.path}:{line}"

    # -- reading --------------------------------------------------------------------------

    def available(self) -> list[str]:
        """The file's column names (a CSV's header, or the schema's ``columns``)."""
        if self.kind == "parquet":
            with storage.open(self.path, "rb") as f:
                return list(pq.ParquetFile(f).schema_arrow.names)
        if not self.schema.header:
            return list(self.schema.columns or [])
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

        return next(csv.reader([header.rstrip("\r")], delimiter=self._parse_options().delimiter), [])

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
            types = {field.name: field.type for field in pq.ParquetFile(f).schema_arrow}
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
            try:
                pf = pq.ParquetFile(f)
            except (pa.ArrowInvalid, OSError) as e:
                raise PreprocessError(f"{self.path}: not a readable Parquet file ({shown(str(e), 200)})") from None
            meta = pf.metadata
            for g in range(meta.num_row_groups):
                size = meta.row_group(g).total_byte_size
                if size > MAX_ROW_GROUP_BYTES:
                    raise PreprocessError(f"{self.path}: row group {g} holds {size} bytes, more than the "
                                          f"{MAX_ROW_GROUP_BYTES} read at once; write it with smaller row groups")  # fmt: skip
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=self.batch_rows, columns=self.columns, use_threads=False):
                    yield row, pa.Table.from_batches([batch])
                    row += batch.num_rows
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
                raise PreprocessError(f"{self.path}: cannot read rows after row {row} ({shown(str(e), 200)})") from None

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
        row = 0
        with self._open() as f:
            try:
                reader = pcsv.open_csv(f, read_options=read, parse_options=self._parse_options(invalid), convert_options=convert)
                pending: list[pa.RecordBatch] = []
                pending_rows = 0
                for batch in reader:
                    pending.append(batch)
                    pending_rows += batch.num_rows
                    if pending_rows >= self.batch_rows:
                        table = pa.Table.from_batches(pending)
                        yield row, table
                        row += table.num_rows
                        pending, pending_rows = [], 0
                if pending_rows:
                    yield row, pa.Table.from_batches(pending)
            except pa.ArrowInvalid as e:
                text = str(e)
                if "straddling" in text or "block" in text:
                    raise PreprocessError(f"{self.path}: a line after row {row} is longer than {MAX_LINE_BYTES} bytes "
                                          "(or a quote is never closed)") from None  # fmt: skip
                raise PreprocessError(f"{self.path}: cannot read it as CSV after row {row} ({shown(text, 200)})") from None
            except (EOFError, OSError) as e:
                raise PreprocessError(f"{self.path}: cannot read it ({shown(str(e), 200)})") from None
