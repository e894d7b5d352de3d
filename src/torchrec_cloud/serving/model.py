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

import operator
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


class CriteoRecords(ValueRows):
    """A request's Criteo rows in their plain form (:meth:`_CriteoRows.plain`), checked and
    half read as ``predict --input`` reads the same fields from a TSV line: per row 13
    integers (a missing one 0) and its 26 hexadecimal ids as one tab-separated line (a missing
    one 0), read for a whole batch at once; a batch of them becomes the shards' records with
    no per-column work in between."""

    FORMS = ("criteo-records",)

    def __init__(self, columns: Sequence[Column], rows: list, dense: list, ids: list) -> None:
        self.columns, self.rows, self.dense, self.ids = columns, rows, dense, ids
        self.num_rows, self.where, self.forms = len(rows), "column", self.FORMS

    def table(self) -> pa.Table:
        """The rows as text columns (to convert one request alone the general way)."""
        return pa.table({c.name: pa.array([None if r[c.name] is None else str(r[c.name]) for r in self.rows], pa.string())
                         for c in self.columns})  # fmt: skip


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
        self.plain: Optional[Any] = getattr(self.converter, "plain", None)
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
_LINE = re.compile(r"(?:-?[0-9]{1,10})?(?:\t(?:-?[0-9]{1,10})?){12}(?:\t[0-9a-fA-F]{0,15}){26}")
# The plain form's checks of the same fields: an integer given as text; the 26 ids joined by
# tabs, a missing one written 00000000 (0 in Criteo's width, see _hex_ids).
_DECIMAL_TEXT = re.compile(r"-?[0-9]{1,10}")
_IDS_LINE = re.compile(r"[0-9a-fA-F]{1,15}(?:\t[0-9a-fA-F]{1,15}){25}")
_HEX_BASE = (16,) * 26
_IDS_LINE_OF_8 = 26 * 8 + 25  # the length of a line of 26 ids of 8 digits each, Criteo's own width
_TABS_OF_8 = "\t" * 25


def _hex_ids(lines: list[str]) -> np.ndarray:
    """``[len(lines), 26]`` int64: the ids of lines that passed :data:`_IDS_LINE`. Where every
    id has 8 digits (Criteo's), the lines are read at once (``bytes.fromhex`` skips the tabs),
    else id by id. A line's length alone does not say so (ids of 6 and 10 digits fill it too,
    and would be read across): its 25 tabs must stand every 9th character."""
    if all(len(line) == _IDS_LINE_OF_8 and line[8::9] == _TABS_OF_8 for line in lines):
        return np.frombuffer(bytes.fromhex("".join(lines)), ">u4").reshape(len(lines), 26).astype(np.int64)
    return np.array([list(map(int, line.split("\t"), _HEX_BASE)) for line in lines], np.int64)


class _CriteoRows:
    """Raw Criteo fields (``int_0`` .. ``int_12``, ``cat_0`` .. ``cat_25``; empty or null:
    missing) through preprocessing's TSV parser with the model's table sizes, then the shards'
    conversion to a batch, as ``predict --input FILE.tsv`` reads a file of the same rows."""

    def __init__(self, cfg: Any) -> None:
        from torchrec_cloud.data.criteo_format import DENSE_NAMES, INT32_MAX, SPARSE_NAMES
        from torchrec_cloud.data.criteo_reader import CriteoTSV

        self.tsv = CriteoTSV("the request", batch_size=1, table_sizes=cfg.model.table_sizes,
                             dense_transform=cfg.data.dense_transform, multi_hot_sizes=cfg.data.multi_hot_sizes,
                             multi_hot_pooling=cfg.data.multi_hot_pooling, seed=cfg.data.seed)  # fmt: skip
        self.columns = [Column(n, CRITEO_INT) for n in DENSE_NAMES] + [Column(n, CRITEO_HEX) for n in SPARSE_NAMES]
        self._ints_of, self._cats_of = operator.itemgetter(*DENSE_NAMES), operator.itemgetter(*SPARSE_NAMES)
        self._int32_max = INT32_MAX  # read here, not at every request (plain)

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

    def _shifted(self, records: np.ndarray, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The records and, per row, its request's shift of the ``torchrec`` dense transform."""
        if self.tsv.dense_transform == "log1p" or not len(records):
            return records, np.zeros(len(records), np.int64)
        starts = np.cumsum([0, *sizes[:-1]])
        smallest = np.minimum.reduceat(records["dense"].min(axis=1), starts).astype(np.int64)
        return records, np.repeat(smallest - 2, sizes)

    def plain(self, rows: list) -> Optional[CriteoRecords]:
        """v1 rows (JSON objects) read as ``predict`` reads the same fields of a TSV line, when
        every field is in its plain form (int_*: an integer within int32, integer text, null;
        cat_*: hexadecimal text of at most 15 digits, empty or null). None otherwise (a missing
        column, a value of another type or form, an integer out of range): the caller then
        checks them column by column, which names the fault."""
        ints_of, cats_of, int32_max = self._ints_of, self._cats_of, self._int32_max
        dense, ids = [], []
        try:
            for row in rows:
                values = ints_of(row)
                if None in values:
                    values = [0 if v is None else v for v in values]
                kinds = set(map(type, values))
                if kinds != {int}:
                    if not kinds <= {int, str}:  # a float, a boolean, a list: the general way
                        return None
                    values = [v if v.__class__ is int else int(v) if _DECIMAL_TEXT.fullmatch(v) else 0 if v == "" else None
                              for v in values]  # fmt: skip
                    if None in values:
                        return None
                if min(values) < -int32_max or max(values) > int32_max:
                    return None
                cats = cats_of(row)
                if None in cats or "" in cats:  # 0, in Criteo's usual width (see _hex_ids)
                    cats = ["00000000" if v is None or v == "" else v for v in cats]
                line = "\t".join(cats)  # joining raises TypeError on anything but text
                if not _IDS_LINE.fullmatch(line):
                    return None
                dense.append(values)
                ids.append(line)
        except (KeyError, TypeError):
            return None
        return CriteoRecords(self.columns, rows, dense, ids)

    def convert_values(self, requests: Sequence[ValueRows], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`convert`, from the requests' values: plain-form records (:meth:`plain`, checked
        already) straight to the shards' records; otherwise the same TSV lines, written without
        arrow (a row per line, fields as text), where a field that fails its check is a
        RequestError that does not say which (the caller converts each request alone for that)."""
        if isinstance(requests[0], CriteoRecords):  # a group has one form: all of them are
            records = np.zeros(sum(sizes), self.tsv.dtype)
            records["dense"] = [d for r in requests for d in r.dense]
            records["sparse"] = _hex_ids([line for r in requests for line in r.ids]) % self.tsv.table_sizes
            return self._shifted(records, sizes)
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
