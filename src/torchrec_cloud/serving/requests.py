"""A request's rows: KServe's v1 ``instances`` and Open Inference Protocol (v2) ``inputs``
checked and turned into the model's :class:`~torchrec_cloud.serving.model.ValueRows` (the
forms each column may take are in :mod:`~torchrec_cloud.serving.server`'s and docs/serving.md's
words); anything else is a :class:`Refused` answer, a 4xx with one line naming the column or
the limit."""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

from torchrec_cloud.serving.model import (CRITEO_HEX, CRITEO_INT, FLOATS, ID, IDS, INT_LISTS, INTS, NULLS, NUMBER,
                                          TEXT, TEXT_LISTS, VALUES, Column, ValueRows)  # fmt: skip

V2_TYPES = {"INT32": "int", "INT64": "int", "FP32": "float", "FP64": "float", "BYTES": "text"}


class Refused(Exception):
    """A request answered with ``status`` and a one-line JSON error."""

    def __init__(self, status: int, message: str, retry_after: bool = False) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def _type(v: Any) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "text",
                                     list: "a list", dict: "an object"}.get(type(v), type(v).__name__)  # fmt: skip


def column_form(c: Column, values: list, where: str) -> str:
    """Check a request column's values (decoded JSON; ``""`` made None in place) and say the
    form of the arrow array the model converts (:func:`~torchrec_cloud.serving.model.arrow_column`):
    numbers, ids or lists as they are, or, when any value is text, the column as CSV-cell text
    (an empty string is missing). A value of the wrong type is a Refused(400) naming the column
    and row."""

    def wrong(i: int, expected: str) -> Refused:
        return Refused(400, f"{where} {c.name}: row {i}: expected {expected}, got {_type(values[i])}")

    if c.kind == IDS:
        texts = inner_text = False
        for i, v in enumerate(values):
            if v is None:
                continue
            if v.__class__ is str:
                if v == "":
                    values[i] = None
                else:
                    texts = True
            elif not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, (int, str)) for x in v):
                raise wrong(i, f"a list of ids, or text with ids joined by {c.separator!r}")
            else:
                inner_text = inner_text or any(isinstance(x, str) for x in v)
        return TEXT if texts else TEXT_LISTS if inner_text else INT_LISTS
    allowed, expected = _ALLOWED.get(c.kind, _ALLOWED[ID])
    texts = floats = False
    values_ = 0  # values that are not missing
    for i, v in enumerate(values):  # one pass: it runs for every column of every request
        if v is None:
            continue
        cls = v.__class__
        if cls is str:
            if v == "":
                values[i] = None
                continue
            texts = True
        elif cls not in allowed:
            raise wrong(i, expected)
        elif cls is float:
            if not math.isfinite(v):
                raise Refused(400, f"{where} {c.name}: row {i}: {v!r} is not a finite number")
            floats = True
        values_ += 1
    if texts or c.kind in (CRITEO_INT, CRITEO_HEX):
        return TEXT
    if c.kind == NUMBER:
        return FLOATS
    if not values_:  # typed, so that an integer id column of nulls converts
        return NULLS
    return VALUES if floats else INTS


# A column kind's JSON types (exact: a boolean is no number) and what the error expects.
_ALLOWED = {NUMBER: ((int, float, str), "a number"), ID: ((int, float, str), "an id"),
            CRITEO_INT: ((int, str), "an integer"), CRITEO_HEX: ((str,), "a hexadecimal id as text")}  # fmt: skip


try:  # the serve extra installs it; json alone answers the same
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - depends on what is installed
    _orjson_loads = None

Plain = Optional[Callable[[list], Optional[ValueRows]]]
"""A model's v1 rows in their plain form straight to what it converts, else None
(:attr:`~torchrec_cloud.serving.model.ServedModel.plain`)."""


def decode(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise Refused(400, f"the body is not JSON ({str(e)[:120]})") from None


def decode_v1(body: bytes, columns: list[Column], max_rows: int, plain_form: Plain = None) -> tuple[Any, ValueRows]:
    """A v1 body: its JSON and its rows. Rows in the model's plain form (``plain_form`` takes them)
    are decoded by orjson where it is installed; anything else, or anything orjson refuses, by
    json and :func:`rows_v1`, which answers it. So orjson never decides an answer: where it
    reads a value otherwise (an integer past 64 bits becomes a float), the plain form fails."""
    if plain_form is not None and _orjson_loads is not None:
        try:
            payload = _orjson_loads(body)
        except ValueError:  # orjson.JSONDecodeError
            payload = None
        rows = payload.get("instances") if isinstance(payload, dict) else None
        if isinstance(rows, list) and 0 < len(rows) <= max_rows and all(r.__class__ is dict for r in rows):
            plain = plain_form(rows)
            if plain is not None:
                return payload, plain
        plain_form = None  # not plain: json's values go the general way
    payload = decode(body)
    return payload, rows_v1(payload, columns, max_rows, plain_form)


def rows_v1(payload: Any, columns: list[Column], max_rows: int, plain_form: Plain = None) -> ValueRows:
    """``{"instances": [{column: value, ...}, ...]}`` as the model's columns' values (as
    ``plain_form`` takes them when it does)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("instances"), list):
        raise Refused(400, 'expected {"instances": [row, ...]} with one JSON object per row')
    rows = payload["instances"]
    _check_count(len(rows), max_rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise Refused(400, f"instances[{i}] is {_type(row)}, not an object of the schema's columns")
    plain = None if plain_form is None else plain_form(rows)
    if plain is not None:
        return plain
    values, forms = {}, {}
    one = rows[0] if len(rows) == 1 else None
    for c in columns:
        try:
            values[c.name] = column = [one[c.name]] if one is not None else [r[c.name] for r in rows]
        except KeyError:
            i = next(i for i, r in enumerate(rows) if c.name not in r)
            raise Refused(400, f"instances[{i}] has no column {c.name} (null for a missing value)") from None
        form = None
        if one is not None:  # a one-row request's usual values decide their form at a glance
            v = column[0]
            form = (TEXT if v else None) if v.__class__ is str else _ONE_VALUE.get((c.kind, v.__class__))
        forms[c.name] = form or column_form(c, column, "column")
    return ValueRows(columns, values, forms, len(rows), "column")


# The form column_form gives a column of one value of a kind and a class (a text value that is
# not empty is TEXT in every kind; floats, lists and empty text go through column_form).
_ONE_VALUE = {(CRITEO_INT, int): TEXT, (CRITEO_INT, type(None)): TEXT, (CRITEO_HEX, type(None)): TEXT,
              (NUMBER, int): FLOATS, (NUMBER, type(None)): FLOATS, (ID, int): INTS, (ID, type(None)): NULLS,
              (IDS, type(None)): INT_LISTS}  # fmt: skip


def rows_v2(payload: Any, columns: list[Column], max_rows: int) -> ValueRows:
    """Open Inference Protocol v2 ``inputs``: one tensor per column, shape ``[N]``."""
    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), list):
        raise Refused(400, 'expected {"inputs": [{"name", "shape", "datatype", "data"}, ...]}')
    given: dict[str, Any] = {}
    for k, t in enumerate(payload["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise Refused(400, f"inputs[{k}] is not a tensor with a name")
        given[t["name"]] = t
    n: Optional[int] = None
    values, forms = {}, {}
    for c in columns:
        t = given.get(c.name)
        if t is None:
            raise Refused(400, f"no input named {c.name} (every column of the schema is needed; BYTES '' for missing)")
        shape, data, dtype = t.get("shape"), t.get("data"), t.get("datatype")
        if dtype not in V2_TYPES:
            raise Refused(400, f"input {c.name}: datatype {str(dtype)[:20]!r} is not one of {', '.join(V2_TYPES)}")
        if (not isinstance(shape, list) or len(shape) != 1 or isinstance(shape[0], bool)
                or not isinstance(shape[0], int) or shape[0] < 0):  # fmt: skip
            raise Refused(400, f"input {c.name}: shape must be [N], got {str(shape)[:40]}")
        _check_count(shape[0], max_rows)
        if not isinstance(data, list) or len(data) != shape[0]:
            raise Refused(400, f"input {c.name}: data must be a flat list of {shape[0]} values (its shape)")
        if n is not None and shape[0] != n:
            raise Refused(400, f"input {c.name}: shape [{shape[0]}], another input has [{n}]")
        n = shape[0]
        kind = V2_TYPES[dtype]
        for i, v in enumerate(data):
            ok = v is None or (isinstance(v, str) if kind == "text" else isinstance(v, int) and not isinstance(v, bool)
                               if kind == "int" else isinstance(v, (int, float)) and not isinstance(v, bool))  # fmt: skip
            if not ok:
                raise Refused(400, f"input {c.name}: row {i}: {_type(v)} in a {dtype} tensor")
        if c.kind == IDS and kind != "text":
            raise Refused(400, f"input {c.name}: a list column is sent as BYTES, its ids joined by {c.separator!r}")
        values[c.name] = data = list(data)
        forms[c.name] = column_form(c, data, "input")
    assert n is not None  # columns is never empty
    return ValueRows(columns, values, forms, n, "input")


def _check_count(n: int, max_rows: int) -> None:
    if n == 0:
        raise Refused(400, "the request has no rows")
    if n > max_rows:
        raise Refused(413, f"{n} rows: over the limit of {max_rows} a request (--max_request_rows)")
