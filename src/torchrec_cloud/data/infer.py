"""``torchrec-cloud data schema --input URL``: a schema proposed from a Parquet or CSV file's
column types and a sample of its values, for the user to read and edit::

    torchrec-cloud data schema --input s3://bucket/events/day_0.parquet --output schema.yaml

The proposal is YAML with a comment on every column (its type, distinct values and missing
share in the sample, and why it was given its role); a column's name is written as a JSON
string, and escaped in comments, so no name can add a line of its own. Rules, in order:

- the label: a 0/1 (or true/false) column named like a label (``label``, ``click``,
  ``clicked``, ``target``, ...), else the first 0/1 column; a rating-like column
  (``rating``, ``score``, ``stars``) becomes a threshold (``>= 4`` out of 5);
- a time column (a timestamp or date, or a column named ``ts``, ``time``, ``timestamp``,
  ``date``, ...) proposes the split: validation from the sample's 80th percentile, test from
  its 90th;
- lists (a list column, or text holding ``|``) and text are sparse features (``vocab``
  below a million distinct ids in the sample, else ``hash``); text that differs on nearly
  every row (an order id) is left out, commented;
- integers named like ids (``id``, ``..._id``, ``...Id``, ``user``, ``item``, ``category``,
  ``zip``, ...) are sparse, other numbers dense (``log1p`` when non-negative and skewed,
  else ``standardize``); a number with more than two distinct values is also bucketized
  (``transform: bucketize`` with its default ``boundaries: label``, at most
  ``PROPOSED_BUCKETS`` buckets, keeping that as its dense input), so that thresholds in it are
  learned as steps. On data whose label steps in numbers (bench/RESULTS.md, issue #39) this
  reached LightGBM; 64 buckets found the same boundaries (the label's steps are fewer than 32)
  and the same AUC within what tables' initial values move, so the proposal keeps the smaller
  tables; 64 quantile buckets, the proposal before label boundaries, stayed under it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from torchrec_cloud import storage
from torchrec_cloud.data.schema import DEFAULT_BUCKETS, Schema
from torchrec_cloud.data.tabular import Input, kind
from torchrec_cloud.untrusted import shown

SAMPLE_ROWS = 100_000
PROPOSED_BUCKETS = DEFAULT_BUCKETS
LABEL_NAMES = ("label", "click", "clicked", "is_click", "clk", "target", "y", "converted", "conversion", "purchase",
               "purchased", "liked", "like")  # fmt: skip
RATING_NAMES = ("rating", "score", "stars", "grade")
TIME_NAMES = ("ts", "time", "timestamp", "date", "datetime", "event_time", "event_ts", "created_at", "day", "unix_time")
_ID_NAME = re.compile(r"(^|_)(id|uid|user|item|product|category|cat|code|zip|country|city|region|brand|shop|store|ad|"
                      r"campaign|genre|occupation)s?$|Id$|ID$", re.IGNORECASE)
_INT = r"^\s*[-+]?\d{1,18}\s*$"
_NUM = r"^\s*[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?)\s*$"


def _sample(path: str, rows: int) -> pa.Table:
    """The first ``rows`` rows of every column (a CSV's as text)."""
    from torchrec_cloud.data.schema import Dense, Label, Sparse

    stand_in = Schema("sample", Label("x"), (Dense("x", "x"),), (Sparse("x", "x"),))
    names = Input(path, stand_in).available()  # a column named twice is an error
    reader = Input(path, stand_in, columns=names)
    if kind(path) == "parquet":  # read as preprocessing reads it: bounded by what it decodes to
        parts, got = [], 0
        for _, table in reader._parquet():
            parts.append(table)
            got += table.num_rows
            if got >= rows:
                break
        if parts:
            return pa.concat_tables(parts).slice(0, rows)
        with storage.open(path, "rb") as f:
            return reader.parquet_file(f).schema_arrow.empty_table()
    # A CSV: every column, as text, through the same reader as preprocessing.
    parts, got = [], 0
    for _, table in reader._csv():
        parts.append(table)
        got += table.num_rows
        if got >= rows:
            break
    return pa.concat_tables(parts).slice(0, rows) if parts else pa.table({n: pa.array([], pa.string()) for n in names})


def _ident(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_]", "_", name).strip("_") or "feature"
    if base[0].isdigit():
        base = "f_" + base
    base = base[:60]
    out, k = base, 2
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def _nice(n: float) -> int:
    """A round table size at least ``n``."""
    if n <= 1000:
        return 1000
    exp = 10 ** int(math.floor(math.log10(n)))
    for m in (1, 2, 5, 10):
        if m * exp >= n:
            return int(m * exp)
    return int(10 * exp)


class _Col:
    """What the sample says about one column."""

    def __init__(self, name: str, arr: pa.ChunkedArray, csv: bool) -> None:
        self.name = name
        arr = arr.combine_chunks()
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        self.type = arr.type
        self.n = len(arr)
        self.missing = arr.null_count / max(self.n, 1)
        self.is_list = pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
        self.element = "string"
        values = arr
        if csv and pa.types.is_string(arr.type):
            present = arr.drop_null()
            has_sep = pc.sum(pc.cast(pc.match_substring(present, "|"), pa.int64())).as_py() or 0
            if len(present) and has_sep >= 0.1 * len(present):
                self.is_list = True
                values = pc.list_flatten(pc.split_pattern(present, "|"))
            self.kind = self._text_kind(values if self.is_list else present)
        elif self.is_list:
            values = pc.list_flatten(arr)
            self.kind = "int" if pa.types.is_integer(values.type) else "string"
        elif pa.types.is_boolean(arr.type):
            self.kind = "bool"
        elif pa.types.is_integer(arr.type):
            self.kind = "int"
        elif pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type):
            self.kind = "float"
        elif pa.types.is_timestamp(arr.type) or pa.types.is_date(arr.type):
            self.kind = "time"
        elif pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            self.kind = "string"
        else:
            self.kind = "other"
        if self.is_list:
            self.element = self.kind if self.kind in ("int", "string") else "string"
        self.values = values.drop_null() if not self.is_list else values
        self.distinct = len(pc.unique(self.values)) if self.kind != "other" else 0
        self.numbers: Optional[np.ndarray] = None
        if self.kind in ("int", "float", "bool") and not self.is_list:
            self.numbers = pc.cast(self.values, pa.float64()).to_numpy(zero_copy_only=False)
            self.numbers = self.numbers[~np.isnan(self.numbers)]

    @staticmethod
    def _text_kind(values: pa.Array) -> str:
        if not len(values):
            return "string"
        if pc.all(pc.match_substring_regex(values, _INT)).as_py():
            return "int"
        if pc.all(pc.match_substring_regex(values, _NUM)).as_py():
            return "float"
        lowered = pc.utf8_lower(values)
        if pc.all(pc.is_in(lowered, pa.array(["true", "false"]))).as_py():
            return "bool"
        return "string"

    @property
    def binary(self) -> bool:
        return self.numbers is not None and len(self.numbers) > 0 and bool(np.isin(self.numbers, (0.0, 1.0)).all())

    def describe(self) -> str:
        if self.is_list:
            what = f"list of {self.element}"
        elif pa.types.is_string(self.type) and self.kind in ("int", "float"):
            what = f"{self.kind} (as text)"
        else:
            what = str(self.type)
        return shown(f"{what}, {self.distinct:,} distinct in {self.n:,} sampled rows, {100 * self.missing:.0f}% missing", 300)


def propose(path: str, rows: int = SAMPLE_ROWS) -> tuple[str, list[str]]:
    """The proposed schema as YAML text, and notes for the user (what to check first)."""
    table = _sample(path, rows)
    csv = kind(path) == "csv"
    cols = [_Col(name, table.column(name), csv) for name in table.column_names]
    notes: list[str] = []
    label = next((c for c in cols if c.name.lower() in LABEL_NAMES and c.binary), None) or next(
        (c for c in cols if c.binary and not c.is_list), None)  # fmt: skip
    threshold = None
    if label is None:
        rating = next((c for c in cols if c.name.lower() in RATING_NAMES and c.numbers is not None and len(c.numbers)), None)
        if rating is not None:
            label = rating
            top = float(np.max(rating.numbers))
            threshold = 4.0 if top == 5 else float(np.quantile(rating.numbers, 0.8))
    time_col = next((c for c in cols if c.kind == "time"), None) or next(
        (c for c in cols if c.name.lower() in TIME_NAMES and c.kind in ("int", "float", "string") and not c.is_list), None)  # fmt: skip
    lines = [f"# Proposed by torchrec-cloud data schema from {shown(path, 300)} ({table.num_rows:,} rows sampled).",
             "# Read every line: each column's role, transform and table size is a guess. docs/data.md",
             "# describes every field; check it with: torchrec-cloud data preprocess --schema THIS ...",
             "name: " + _ident(re.sub(r"\.(parquet|pq|csv|tsv|txt)(\.gz)?$", "", path.rstrip("/").rsplit("/", 1)[-1]), set()),
             ""]  # fmt: skip
    if label is None:
        lines += ["label: {column: CHANGE_ME}  # no 0/1 column found: name yours (or a numeric one with threshold: N)"]
        notes.append("no label column found: edit `label:` before preprocessing")
    elif threshold is None:
        lines += [f"label: {{column: {json.dumps(label.name)}}}  # {label.describe()}"]
    else:
        lines += [f"label: {{column: {json.dumps(label.name)}, threshold: {threshold:g}}}  # positive when >= {threshold:g}; {label.describe()}"]
        notes.append(f"the label is {shown(label.name)} >= {threshold:g}: check that this is what a positive means")
    taken: set[str] = set()
    dense, sparse, skipped = [], [], []
    for c in cols:
        if c is label or c is time_col:
            continue
        spec = f"column: {json.dumps(c.name)}, " if _ident(c.name, set()) != c.name else ""
        if c.kind == "other":
            skipped.append(f"#   {shown(c.name)}: {c.describe()}: not a type a feature can read")
            continue
        if c.is_list or c.kind == "string" or (c.kind == "int" and _ID_NAME.search(c.name)):
            if not c.is_list and c.kind == "string" and c.n >= 1000 and c.distinct > 0.9 * c.n:
                skipped.append(f"#   {shown(c.name)}: {c.describe()}: differs on almost every row (an id of the row, not a feature)")
                continue
            element = c.element if c.is_list else ("int" if c.kind == "int" else "string")
            mapping = "vocab" if c.distinct < 1_000_000 else "hash"
            rows_needed = _nice(4 * c.distinct + 1)
            extra = ", list: true, pooling: mean" if c.is_list else ""
            min_count = ", min_count: 2" if mapping == "vocab" and c.distinct > 10_000 else ""
            name = _ident(c.name, taken)
            sparse.append(f"  - {{name: {name}, {spec}type: {element}{extra}, mapping: {mapping}, "
                          f"num_embeddings: {rows_needed}{min_count}}}  # {c.describe()}")  # fmt: skip
            continue
        numbers = c.numbers if c.numbers is not None else np.zeros(0)
        if len(numbers) and numbers.min() >= 0 and numbers.max() > 20 * max(float(np.median(numbers)), 1.0):
            transform, why = "log1p", "non-negative and skewed"
        else:
            transform, why = "standardize", "scaled by the training rows' mean and spread"
        name = _ident(c.name, taken)
        if c.distinct > 2:
            dense.append(f"  - {{name: {name}, {spec}transform: bucketize, buckets: {PROPOSED_BUCKETS}, keep_dense: "
                         f"{transform}}}  # bucketized where the training label steps; kept as {transform}: {why}; {c.describe()}")  # fmt: skip
            continue
        dense.append(f"  - {{name: {name}, {spec}transform: {transform}}}  # {why}; {c.describe()}")
    lines += ["", "dense:"] + (dense or ["  []  # no numeric column: a model needs at least one dense feature"])
    lines += ["", "sparse:"] + (sparse or ["  []  # no id column found"])
    if not dense:
        notes.append("no numeric column for a dense feature: add one (a count, a price)")
    if time_col is not None:
        bounds = _time_bounds(time_col, table.column(time_col.name))
        if bounds is not None:
            lines += ["", f"split: {{by: {json.dumps(time_col.name)}, val_from: {bounds[0]}, test_from: {bounds[1]}}}"
                      f"  # by time: the sample's 80th and 90th percentiles; {time_col.describe()}"]  # fmt: skip
    else:
        lines += ["", "# split: {by: COLUMN, val_from: V, test_from: T}  # no time column found: rows are split",
                  "#   80/10/10 by a hash of each row unless you name one (or use --split_by)"]  # fmt: skip
    if skipped:
        lines += ["", "# Left out:"] + skipped
    return "\n".join(lines) + "\n", notes


def _time_bounds(col: _Col, arr: pa.ChunkedArray) -> Optional[tuple[str, str]]:
    arr = arr.combine_chunks().drop_null()
    if not len(arr):
        return None
    if col.kind == "time" or (pa.types.is_string(arr.type) and col.kind == "string"):
        ordered = pc.sort_indices(arr)
        pick = [ordered[int(q * (len(arr) - 1))].as_py() for q in (0.8, 0.9)]
        values = [arr[i].as_py() for i in pick]
        return tuple(json.dumps(v.isoformat() if hasattr(v, "isoformat") else str(v)) for v in values)  # type: ignore[return-value]
    numbers = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
    q = np.quantile(numbers, (0.8, 0.9))
    return tuple(f"{int(v)}" if float(v).is_integer() or col.kind == "int" else f"{v:g}" for v in q)  # type: ignore[return-value]
