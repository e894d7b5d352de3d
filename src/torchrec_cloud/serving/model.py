"""A served model: an exported model folder loaded once, raw rows in, click probabilities out,
and nothing of HTTP (``server.py`` owns the protocols)::

    model = ServedModel("models/ev")
    model.load()                                  # scorer, transforms; scores the canary rows
    model.columns                                 # what a request must carry: name and kind
    [p] = model.predict([table])                  # pyarrow rows of those columns -> float64 [N]
    p, q = model.predict([ValueRows(...), ValueRows(...)])  # requests' decoded values, converted together

It has the shape of KServe's Python model (``load()``, ``ready``, ``predict``). Rows are
converted by the code ``predict --input`` runs on a file: for a model of a schema's dataset,
:class:`~torchrec_cloud.data.transforms.Transforms` with the vocabularies, hash rule and dense
statistics ``export`` put in the folder, then the batches training read
(:func:`~torchrec_cloud.data.reader.batch_of`); for a Criteo model, preprocessing's TSV
parser (``criteo_parse.parse_block``) on the request's fields and the shards' own record-to-batch
code. So a row scores here as it does in ``predict --input`` (tests/test_serve.py checks both).

A batch's requests are converted together, in one call of that code, when their values take
the same arrow types (:class:`ValueRows`): the conversion's cost is mostly per call, not per
row, so a one-row request would otherwise pay for a whole batch. A request whose rows do not
convert is converted again alone, to answer it (and only it) with its error.

Criteo's ``torchrec`` dense transform is ``log(x - (m - 2))`` with ``m`` the smallest value of
the file scored; here the file is the request, so ``m`` is the request's smallest dense value
(a model trained with ``--dense_transform log1p`` scores each row on its own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from torchrec_cloud import storage
from torchrec_cloud.serving import CONFIG_FILE, SCORER_FILE, ServingError, read_model_config, saved_job_config
from torchrec_cloud.untrusted import UntrustedInputError

# Kinds of request column: a number (a dense feature), one id, a list of ids (BYTES joined by
# the schema's separator, or a JSON list), and Criteo's integer and hexadecimal fields.
NUMBER, ID, IDS, CRITEO_INT, CRITEO_HEX = "number", "id", "ids", "int", "hex"


@dataclass(frozen=True)
class Column:
    """One column a request carries: its name, kind, and a list's separator."""

    name: str
    kind: str
    separator: str = "|"


class RequestError(ValueError):
    """Rows the model cannot score (a value that does not convert): the request's fault, one line."""


# How a request column's decoded values become one arrow array (what ``arrow_column`` builds):
# as CSV-cell text; numbers as float64; integer ids as int64; ids with a float among them as
# arrow infers them (float64); a column of nulls only as text; a list column's JSON lists of
# integer ids, or of text ids. Stacking requests of one form gives each row the type it has alone.
TEXT, FLOATS, INTS, VALUES, NULLS = "text", "floats", "ints", "values", "nulls"
INT_LISTS, TEXT_LISTS = "int_lists", "text_lists"


def arrow_column(c: Column, form: str, values: list, where: str = "column") -> pa.Array:
    """A column's values (JSON-decoded, checked by the protocol, ``""`` already None) as the
    arrow array ``predict --input`` would read from a file. A value arrow cannot hold (a number
    beyond float64's exact integers, an id beyond 64 bits) is a RequestError naming the column."""
    try:
        if form == TEXT:
            if c.kind == IDS:
                return pa.array([v if not isinstance(v, list) else c.separator.join(map(str, v)) for v in values],
                                pa.string())  # fmt: skip
            return pa.array([v if v is None or isinstance(v, str) else repr(v) for v in values], pa.string())
        if form == FLOATS:
            return pa.array(values, pa.float64())
        if form == NULLS:
            return pa.array(values, pa.string())
        if form == INTS:
            return pa.array(values, pa.int64())
        if form == INT_LISTS:
            return pa.array(values, pa.list_(pa.int64()))
        if form == TEXT_LISTS:
            return pa.array([None if v is None else [str(x) for x in v] for v in values], pa.list_(pa.string()))
        return pa.array(values)
    except (pa.ArrowException, OverflowError):
        what = "a number out of range" if c.kind == NUMBER else "ids must fit in 64 bits"
        raise RequestError(f"{where} {c.name}: {what}") from None


class ValueRows:
    """One request's rows as the protocol decoded and checked them: each column's values and
    the form (``TEXT``, ``FLOATS``, ...) its arrow array takes. Requests whose columns all take
    the same forms are converted together, as one table (their values concatenated), which is
    the table each would have been alone, stacked."""

    def __init__(self, columns: Sequence[Column], values: dict[str, list], forms: dict[str, str], num_rows: int,
                 where: str = "column") -> None:  # fmt: skip
        self.columns, self.values, self.num_rows, self.where = columns, values, num_rows, where
        self.forms = tuple(forms[c.name] for c in columns)

    def table(self) -> pa.Table:
        return ValueRows.stacked([self])

    @staticmethod
    def stacked(requests: Sequence["ValueRows"]) -> pa.Table:
        """The rows of requests of the same forms as one table (a RequestError: one does not fit)."""
        first = requests[0]
        arrays = {}
        for c, form in zip(first.columns, first.forms):
            if len(requests) == 1:
                values = first.values[c.name]
            else:
                values = [v for r in requests for v in r.values[c.name]]
            arrays[c.name] = arrow_column(c, form, values, first.where)
        return pa.table(arrays)


class CriteoLines(ValueRows):
    """A request's Criteo rows as the TSV lines ``predict --input`` reads (label left out),
    each checked by its columns' patterns when it was made (:meth:`_CriteoRows.lines`): a
    batch of them is joined and parsed, with no per-column work in between."""

    FORMS = ("criteo-lines",)

    def __init__(self, columns: Sequence[Column], lines: list[str]) -> None:
        self.columns, self.lines, self.num_rows, self.where = columns, lines, len(lines), "column"
        self.forms = self.FORMS

    def table(self) -> pa.Table:
        """The rows as text columns (to convert one request alone, naming a field that fails)."""
        fields = [line.split("\t") for line in self.lines]
        return pa.table({c.name: pa.array([f[k] or None for f in fields], pa.string()) for k, c in enumerate(self.columns)})


class ServedModel:
    """One exported model folder (local or a bucket URL), ready to score raw rows."""

    def __init__(self, model_dir: str, version: Optional[str] = None, runtime: str = "auto") -> None:
        self.model_dir, self.runtime = model_dir, runtime  # serving.runtime.RUNTIMES
        self.version = version or model_dir.rstrip("/").rsplit("/", 1)[-1] or "1"
        self.ready = False
        self.config = read_model_config(model_dir)  # cheap: a bad folder is refused before load()
        self.cfg = saved_job_config(self.config, storage.join(model_dir, CONFIG_FILE))
        if "transforms" in self.config:
            self.converter: Union[_SchemaRows, _CriteoRows] = _SchemaRows(self.config, model_dir, self.cfg)
        elif self.cfg.model.num_dense_features == 13 and self.cfg.model.num_sparse_features == 26:
            self.converter = _CriteoRows(self.cfg)
        else:
            raise ServingError(f"{model_dir} scores neither a schema's rows nor Criteo's (a synthetic-data model?): "
                               "serve needs a model trained on a schema's dataset or on Criteo data")  # fmt: skip
        self.columns: list[Column] = self.converter.columns
        # v1 rows straight to what the converter takes, or None where they are not in its plain
        # form (the protocol then checks them column by column and names what is wrong).
        self.lines: Optional[Any] = getattr(self.converter, "lines", None)
        self.scorer: Any = None

    def load(self) -> None:
        """Read the scorer and score the canary rows once (the first call also warms it up):
        ``ready`` after that; a ServingError naming the folder otherwise."""
        from torchrec_cloud.serving.runtime import load_scorer

        # The AOTInductor package when the folder has one built by this torch (runtime
        # "auto"), else TorchScript: serving.runtime.
        self.scorer = load_scorer(self.model_dir, self.runtime, config=self.config, map_tables=True)
        self.canary()
        self.ready = True

    def canary(self) -> None:
        """Score a few rows built from the columns (one all missing): each must come out a
        probability, or the model is refused."""
        texts = {NUMBER: ["", "0", "1.5", "3"], ID: ["", "1", "7", "42"], IDS: ["", "1", "1{sep}7", "42"],
                 CRITEO_INT: ["", "0", "1", "5"], CRITEO_HEX: ["", "0", "a1", "ff"]}  # fmt: skip
        table = pa.table({c.name: pa.array([t.replace("{sep}", c.separator) or None for t in texts[c.kind]], pa.string())
                          for c in self.columns})  # fmt: skip
        try:
            [out] = self.predict([table])
        except Exception as e:  # noqa: BLE001 - any failure refuses the model, named
            raise ServingError(f"{self.model_dir}: the canary rows do not score ({type(e).__name__}: {e})") from None
        if isinstance(out, Exception):
            raise ServingError(f"{self.model_dir}: the canary rows do not convert ({out})")
        if out.shape != (4,) or not np.all(np.isfinite(out)) or not np.all((out >= 0) & (out <= 1)):
            raise ServingError(f"{self.model_dir}: the canary rows score {out.tolist()}, not 4 probabilities")

    def predict(self, requests: Sequence[Union[pa.Table, ValueRows]]) -> list[Union[np.ndarray, RequestError]]:
        """Click probabilities (float64) of each request's rows (a table, or the values a
        protocol decoded), scored together as one batch: for each request its probabilities,
        or the RequestError that its rows raised (the other requests are scored all the same)."""
        import torch

        results: list[Union[np.ndarray, RequestError]] = [np.empty(0)] * len(requests)
        groups: dict[Any, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.forms if isinstance(r, ValueRows) else i, []).append(i)  # a table alone
        parts, owners = [], []  # converted parts, in batch order; (request, rows) in the same order
        for members in groups.values():
            group = [requests[i] for i in members]
            sizes = [r.num_rows for r in group]
            try:
                if isinstance(group[0], ValueRows):
                    parts.append(self.converter.convert_values(group, sizes))
                else:
                    parts.append(self.converter.convert(group[0], sizes))
                owners += zip(members, sizes)
                continue
            except RequestError as e:
                if not isinstance(group[0], ValueRows):
                    results[members[0]] = e
                    continue
            for i, r in zip(members, group):  # a bad one among them: each alone, its error naming the column
                try:
                    parts.append(self.converter.convert(r.table(), [r.num_rows]))
                except RequestError as e:
                    results[i] = e
                    continue
                owners.append((i, r.num_rows))
        if parts:
            dense, values, lengths = self.converter.bags(parts)
            with torch.no_grad():
                logits = self.scorer.logits_of_bags(dense, values, lengths)
            probabilities = torch.sigmoid(logits.double()).numpy()
            start = 0
            for i, n in owners:
                results[i] = probabilities[start : start + n]
                start += n
        return results


class _SchemaRows:
    """Rows of a schema's columns through the model folder's transforms (as ``predict --input``)."""

    def __init__(self, config: dict[str, Any], model_dir: str, cfg: Any) -> None:
        from torchrec_cloud.data.dataset import check_transforms, read_vocabularies
        from torchrec_cloud.data.schema import parse_schema
        from torchrec_cloud.data.transforms import Transforms

        where = storage.join(model_dir, CONFIG_FILE)
        try:
            schema = parse_schema(config.get("schema"), f"{where} (schema)")
            spec = check_transforms(config.get("transforms"), schema, where, "transforms")
            if spec["table_sizes"] != cfg.model.table_sizes:
                raise UntrustedInputError(where, "transforms.table_sizes",
                                          f"{spec['table_sizes']} differ from the model's tables {cfg.model.table_sizes}")  # fmt: skip
            vocab = read_vocabularies(model_dir, spec["vocab"], where)
        except UntrustedInputError as e:
            raise ServingError(str(e)) from None
        self.schema = schema
        self.transforms = Transforms(schema, vocab, spec["dense_stats"])
        self.keys = [f.name for f in schema.sparse]
        self.singles = [k for k, f in enumerate(schema.sparse) if not f.list]
        self.lists = [k for k, f in enumerate(schema.sparse) if f.list]
        self.table_sizes = np.asarray(spec["table_sizes"], np.int64)
        cols = {f.column: Column(f.column, NUMBER) for f in schema.dense}
        for f in schema.sparse:
            cols.setdefault(f.column, Column(f.column, IDS if f.list else ID, f.separator))
        self.columns = list(cols.values())

    def convert(self, table: pa.Table, sizes: Sequence[int]) -> Any:
        """``table``: the rows of requests of ``sizes`` rows each, stacked (each row converts alone)."""
        from torchrec_cloud.data.dataset import Rows

        try:
            enc = self.transforms.encode(table, None, labelled=False)
        except (TypeError, pa.ArrowException) as e:
            raise RequestError(" ".join(str(e).split())) from None
        if enc.bad_count:
            row, reason = min(enc.bad.items())
            raise RequestError(f"row {row}: {reason}")
        return Rows(enc.records, enc.lists)

    def convert_values(self, requests: Sequence[ValueRows], sizes: Sequence[int]) -> Any:
        return self.convert(ValueRows.stacked(requests), sizes)

    def bags(self, parts: Sequence[Any]) -> tuple[Any, Any, Any]:
        """The converted parts as one batch's dense features and bags (values, lengths)."""
        from torchrec_cloud.data.dataset import Rows
        from torchrec_cloud.data.reader import batch_of

        rows = Rows.concat(list(parts), self.transforms.dtype, len(self.lists), self.transforms.list_dtype)
        batch = batch_of(rows, self.keys, self.singles, self.lists, self.table_sizes, "the request")
        return batch.dense_features, batch.sparse_features.values(), batch.sparse_features.lengths()


_DECIMAL = r"^-?[0-9]{1,10}$"
_HEX = r"^[0-9a-fA-F]{1,15}$"
# A Criteo row's fields (its label left out) as one TSV line, when each field passes its
# column's check above (or is empty): 13 integers, then 26 hexadecimal ids.
# Up to this many lines, parsing field by field in Python costs less than parse_block's
# array operations (bench/RESULTS.md, 2026-11-29).
_FEW_LINES = 16
_LINE = re.compile(r"(?:-?[0-9]{1,10})?(?:\t(?:-?[0-9]{1,10})?){12}(?:\t[0-9a-fA-F]{0,15}){26}")


class _CriteoRows:
    """Raw Criteo fields (``int_0`` .. ``int_12``, ``cat_0`` .. ``cat_25``; empty or null:
    missing) through preprocessing's TSV parser with the model's table sizes, then the shards'
    conversion to a batch, as ``predict --input FILE.tsv`` reads a file of the same rows."""

    def __init__(self, cfg: Any) -> None:
        from torchrec_cloud.data.criteo_format import DENSE_NAMES, SPARSE_NAMES
        from torchrec_cloud.data.criteo_reader import CriteoTSV

        self.tsv = CriteoTSV("the request", batch_size=1, table_sizes=cfg.model.table_sizes,
                             dense_transform=cfg.data.dense_transform, multi_hot_sizes=cfg.data.multi_hot_sizes,
                             multi_hot_pooling=cfg.data.multi_hot_pooling, seed=cfg.data.seed)  # fmt: skip
        self.columns = [Column(n, CRITEO_INT) for n in DENSE_NAMES] + [Column(n, CRITEO_HEX) for n in SPARSE_NAMES]
        self.int_names, self.cat_names = list(DENSE_NAMES), list(SPARSE_NAMES)

    def convert(self, table: pa.Table, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``table``: the rows of requests of ``sizes`` rows each, stacked; each request is a file
        to the ``torchrec`` dense transform (its own smallest value)."""
        from torchrec_cloud.data.criteo_parse import parse_block

        n = table.num_rows
        fields = [np.full(n, "0", object)]  # the label field the parser expects; not used
        for c in self.columns:
            values = table.column(c.name)
            text = pc.fill_null(pc.cast(values, pa.string()), "")
            ok = pc.or_(pc.equal(text, ""), pc.match_substring_regex(text, _DECIMAL if c.kind == CRITEO_INT else _HEX))
            bad = np.flatnonzero(~ok.to_numpy(zero_copy_only=False))
            if len(bad):
                what = "an integer" if c.kind == CRITEO_INT else "a hexadecimal id of at most 15 digits"
                raise RequestError(f"row {int(bad[0])}: column {c.name}: not {what}: {text[int(bad[0])].as_py()[:40]!r}")
            fields.append(text.to_numpy(zero_copy_only=False))
        return self._records("".join("\t".join(row) + "\n" for row in zip(*fields)).encode(), sizes)

    def _records(self, lines: bytes, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        from torchrec_cloud.data.criteo_parse import parse_block

        parsed = parse_block(lines, self.tsv.table_sizes, self.tsv.dtype)
        if len(parsed.bad_lines):
            first = int(parsed.bad_lines[0])
            raise RequestError(f"row {first}: {parsed.reasons.get(first, 'malformed row')}")
        return self._shifted(parsed.records, sizes)

    def _line_records(self, lines: list[str], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Lines that passed :data:`_LINE` as ``parse_block`` reads them (an empty field is 0; an
        integer must be within int32 (either sign's largest: -(2**31 - 1) at least); ids taken
        modulo the tables), field by field: for a few rows (up to :data:`_FEW_LINES`),
        ``parse_block``'s fixed cost (tens of array operations a call) is most of its time.
        tests/test_serve.py checks that the two read the same records."""
        from torchrec_cloud.data.criteo_format import INT32_MAX

        dense, ids = [], []
        for line in lines:
            fields = line.split("\t")
            dense.append([int(x) if x else 0 for x in fields[:13]])
            ids.append([int(x, 16) if x else 0 for x in fields[13:]])
        values = np.array(dense, np.int64)
        if (np.abs(values) > INT32_MAX).any():  # the caller converts each request alone, to name it
            raise RequestError("an integer field is outside the int32 range")
        records = np.zeros(len(lines), self.tsv.dtype)
        records["dense"] = values
        records["sparse"] = np.array(ids, np.int64) % self.tsv.table_sizes
        return self._shifted(records, sizes)

    def _shifted(self, records: np.ndarray, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The records and, per row, its request's shift of the ``torchrec`` dense transform."""
        if self.tsv.dense_transform == "log1p" or not len(records):
            return records, np.zeros(len(records), np.int64)
        starts = np.cumsum([0, *sizes[:-1]])
        smallest = np.minimum.reduceat(records["dense"].min(axis=1), starts).astype(np.int64)
        return records, np.repeat(smallest - 2, sizes)

    def lines(self, rows: list) -> Optional[CriteoLines]:
        """v1 rows (JSON objects) as TSV lines, when every field is in its plain form (int_*: an
        integer, text, null; cat_*: text or null) and the lines pass :data:`_LINE`: what
        :meth:`convert_values` writes of the same values. None otherwise (a missing column, a
        value of another type or form): the caller then checks them column by column."""
        ints, cats = self.int_names, self.cat_names
        lines = []
        try:
            for row in rows:
                # str() of anything but an integer or text (a number, a boolean, a list) fails
                # _LINE's integer pattern; joining the ids raises TypeError on anything but text.
                dense = "\t".join(["" if v is None else str(v) for v in [row[n] for n in ints]])
                lines.append(dense + "\t" + "\t".join(["" if v is None else v for v in [row[n] for n in cats]]))
        except (KeyError, TypeError):
            return None
        if not all(map(_LINE.fullmatch, lines)):
            return None
        return CriteoLines(self.columns, lines)

    def convert_values(self, requests: Sequence[ValueRows], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`convert`, from the requests' values: the same TSV lines, written without
        arrow (a row per line, fields as text); a field that fails its check is a
        RequestError that does not say which (the caller converts each request alone for that)."""
        if isinstance(requests[0], CriteoLines):  # a group has one form: all of them are
            lines = [line for r in requests for line in r.lines]
            if len(lines) <= _FEW_LINES:
                return self._line_records(lines, sizes)
            return self._records("".join(["0\t" + line + "\n" for line in lines]).encode(), sizes)
        names = [c.name for c in self.columns]
        lines = []
        for r in requests:  # most hold one row: row by row, not column by column
            for fields in zip(*[r.values[name] for name in names]):
                lines.append("\t".join(["" if v is None else v if v.__class__ is str else repr(v) for v in fields]))
        if not all(_LINE.fullmatch(line) for line in lines):
            raise RequestError("a field is not its column's integer or hexadecimal id")
        return self._records("".join("0\t" + line + "\n" for line in lines).encode(), sizes)

    def bags(self, parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any, Any]:
        """The converted parts as one batch's dense features and bags (the shards' conversion)."""
        records = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        shift = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return self.tsv.batcher.bags(records, shift)
