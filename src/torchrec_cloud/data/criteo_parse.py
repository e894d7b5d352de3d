"""Criteo TSV lines to records, a block at a time, vectorised with numpy.

Every input line is ``label \\t 13 integers \\t 26 hexadecimal ids`` (empty fields are
missing values), ending in LF or CRLF::

    parsed = parse_block(data, sizes, record_dtype("int32"))   # data: whole lines
    parsed.records, parsed.bad_lines, parsed.reasons

A bad line (wrong number of fields, a non-integer dense value, a non-hex id, a label other
than 0/1) is left out of ``records`` and listed, with the reason for the first few.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from torchrec_cloud.data.criteo_format import CAT_FEATURES, DENSE_NAMES, FIELDS, INT32_MAX, INT_FEATURES, SPARSE_NAMES
from torchrec_cloud.errors import CommandError


class PreprocessError(CommandError, RuntimeError):
    """Input that cannot be converted (bad line, empty or truncated file)."""


SKIP_HINT = "fix the line, or pass --on_bad_line skip to leave such lines out"


class BadLineError(PreprocessError):
    """A malformed line; the message starts with ``FILE:LINE:`` and ends with what to do
    (``hint``: the command's own, when it takes no ``--on_bad_line``)."""

    def __init__(self, path: str, line: int, reason: str, hint: str = SKIP_HINT) -> None:
        super().__init__(f"{path}:{line}: {reason} ({hint})")
        self.path, self.line, self.reason, self.hint = path, line, reason, hint

    def __reduce__(self) -> Any:  # crosses process boundaries intact
        return (type(self), (self.path, self.line, self.reason, self.hint))



_HEX = np.full(256, -1, dtype=np.int8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_DEC = np.full(256, -1, dtype=np.int8)
for _i, _c in enumerate(b"0123456789"):
    _DEC[_c] = _i


@dataclass
class Parsed:
    """Result of parsing one block: good rows, and the bad lines (0-based in the block)."""

    records: np.ndarray
    bad_lines: np.ndarray
    lines: int
    reasons: dict[int, str] = field(default_factory=dict)


_ONES = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
# _KEEP[n]: the low n bytes of a uint64 (a right-aligned field of n characters).
_KEEP = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype=np.uint64)


def _bytes_between(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per byte of ``x`` (all < 0x80): 0x80 where lo <= byte <= hi, else 0."""
    ge = ((x & _LOW7) + np.uint64(0x80 - lo) * _ONES) & _HIGH
    gt = ((x & _LOW7) + np.uint64(0x7F - hi) * _ONES) & _HIGH
    return ge & ~gt


def _parse_swar(
    padded: np.ndarray, starts: np.ndarray, ends: np.ndarray, base: int
) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """:func:`_parse_numbers` for fields of at most 8 characters, 8 at a time: each field
    is loaded as one big-endian uint64 (right-aligned) and decoded with SIMD-within-a-
    register arithmetic. ``padded`` is the buffer after 8 zero bytes. None if a field is
    longer than 8."""
    lens = ends - starts
    if lens.size and int(lens.max()) > 8:
        return None
    view = np.ndarray(shape=(len(padded) - 7,), dtype=">u8", buffer=padded, strides=(1,))
    x = view[ends].astype(np.uint64) & _KEEP[lens]
    neg = None
    if base == 10:
        first = (x >> (np.maximum(lens - 1, 0) * 8).astype(np.uint64)) & np.uint64(0xFF)
        neg = (lens > 0) & (first == 0x2D)
        x = np.where(neg, x & _KEEP[np.maximum(lens - 1, 0)], x)
        digits_len = lens - neg
    else:
        digits_len = lens
    within = _KEEP[digits_len] & _HIGH
    ascii_ok = (x & _HIGH) == 0
    if base == 16:
        valid = (
            _bytes_between(x, 0x30, 0x39) | _bytes_between(x, 0x61, 0x66) | _bytes_between(x, 0x41, 0x46)
        )
        ok = ascii_ok & ((valid & within) == within)
        v = (x & np.uint64(0x0F0F0F0F0F0F0F0F)) + np.uint64(9) * ((x >> np.uint64(6)) & _ONES)
        v = ((v >> np.uint64(4)) | v) & np.uint64(0x00FF00FF00FF00FF)
        v = ((v >> np.uint64(8)) | v) & np.uint64(0x0000FFFF0000FFFF)
        v = ((v >> np.uint64(16)) | v) & np.uint64(0x00000000FFFFFFFF)
        return v.astype(np.int64), ok
    valid = _bytes_between(x, 0x30, 0x39)
    ok = ascii_ok & ((valid & within) == within) & ~(neg & (lens == 1))
    d = x & np.uint64(0x0F0F0F0F0F0F0F0F)
    m16, m32 = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF)
    d = ((d >> np.uint64(8)) & m16) * np.uint64(10) + (d & m16)
    d = ((d >> np.uint64(16)) & m32) * np.uint64(100) + (d & m32)
    d = (d >> np.uint64(32)) * np.uint64(10000) + (d & np.uint64(0xFFFFFFFF))
    value = d.astype(np.int64)
    return np.where(neg, -value, value), ok


def _parse_numbers(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, base: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Values and a validity mask of the fields ``buf[starts:ends]`` (arrays of any shape).
    Decimal fields may start with '-'; empty fields are 0."""
    lens = ends - starts
    width = int(min(max(int(lens.max(initial=0)), 1), max_len))
    # Right-aligned windows of ``width`` bytes ending at each field's end, gathered through
    # a strided view of the buffer (no per-byte index arrays).
    padded = np.concatenate((np.zeros(width, np.uint8), buf))
    chars = np.lib.stride_tricks.sliding_window_view(padded, width)[ends]
    digit = (_HEX if base == 16 else _DEC)[chars]
    pos = np.arange(width, dtype=np.int64)
    lead = (width - np.minimum(lens, width))[..., None]
    digit[pos < lead] = 0  # bytes before the field
    ok = lens <= max_len
    if base == 10:
        neg = (lens > 0) & (buf[np.minimum(starts, len(buf) - 1)] == 45)
        digit[(pos == lead) & neg[..., None]] = 0
        ok &= ~(neg & (lens == 1))
    else:
        neg = None
    ok &= ~np.any(digit < 0, axis=-1)
    powers = base ** np.arange(width - 1, -1, -1, dtype=np.int64)
    value = digit.astype(np.int64) @ powers
    if neg is not None:
        value = np.where(neg, -value, value)
    return value, ok


def parse_block(data: bytes, sizes: Optional[np.ndarray], dtype: np.dtype) -> Parsed:
    """Parse whole lines (``data`` ends with a newline) into records of ``dtype``; ids are
    taken modulo ``sizes`` when given. Bad lines are left out and listed. Lines may end in
    CRLF (Windows): the ``\\r`` before a ``\\n`` is dropped; one anywhere else is a bad line."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    buf = np.frombuffer(data, dtype=np.uint8)
    seps = np.flatnonzero((buf == 9) | (buf == 10))
    nl_index = np.flatnonzero(buf[seps] == 10)
    newlines = seps[nl_index]
    n = len(newlines)
    if n == 0:
        return Parsed(np.empty(0, dtype), np.empty(0, np.int64), 0)
    line_starts = np.concatenate(([0], newlines[:-1] + 1))
    tab_counts = np.diff(nl_index, prepend=-1) - 1
    shape_ok = tab_counts == FIELDS - 1
    reasons: dict[int, str] = {}
    if not shape_ok.all():
        bad = np.flatnonzero(~shape_ok)
        for i in bad[:8]:
            reasons[int(i)] = (
                f"expected {FIELDS} tab-separated fields (label, {INT_FEATURES} integers, "
                f"{CAT_FEATURES} hex ids), found {int(tab_counts[i]) + 1}"
            )
        keep_bytes = np.repeat(shape_ok, newlines - line_starts + 1)
        inner = parse_block(buf[keep_bytes].tobytes(), sizes, dtype)
        good_index = np.flatnonzero(shape_ok)
        bad_all = np.sort(np.concatenate((bad, good_index[inner.bad_lines])))
        for i, text in inner.reasons.items():
            reasons[int(good_index[i])] = text
        return Parsed(inner.records, bad_all, n, reasons)

    seps = seps.reshape(n, FIELDS)
    starts = np.empty_like(seps)
    starts[:, 0] = line_starts
    starts[:, 1:] = seps[:, :-1] + 1
    k = 1 + INT_FEATURES
    padded = np.concatenate((np.zeros(8, np.uint8), buf))
    ints_parsed = _parse_swar(padded, starts[:, :k], seps[:, :k], 10)
    ints, ints_ok = ints_parsed or _parse_numbers(buf, starts[:, :k], seps[:, :k], 10, 11)
    ids_parsed = _parse_swar(padded, starts[:, k:], seps[:, k:], 16)
    ids, ids_ok = ids_parsed or _parse_numbers(buf, starts[:, k:], seps[:, k:], 16, 15)
    label_ok = ints_ok[:, 0] & (seps[:, 0] > starts[:, 0]) & ((ints[:, 0] == 0) | (ints[:, 0] == 1))
    dense = ints[:, 1:]
    dense_ok = ints_ok[:, 1:] & (dense <= INT32_MAX) & (dense >= -INT32_MAX)
    line_ok = label_ok & dense_ok.all(axis=1) & ids_ok.all(axis=1)

    bad = np.flatnonzero(~line_ok)
    for i in bad[:8]:
        i = int(i)

        def text(col: int) -> str:
            return bytes(buf[starts[i, col] : seps[i, col]]).decode("utf-8", "replace")

        if not label_ok[i]:
            reasons[i] = f"label must be 0 or 1, got {text(0)!r}"
        elif not dense_ok[i].all():
            c = int(np.flatnonzero(~dense_ok[i])[0])
            reasons[i] = (
                f"integer feature {DENSE_NAMES[c]} (field {c + 2}) is not an integer in "
                f"the int32 range: {text(c + 1)!r}"
            )
        else:
            c = int(np.flatnonzero(~ids_ok[i])[0])
            reasons[i] = (
                f"categorical feature {SPARSE_NAMES[c]} (field {c + 2 + INT_FEATURES}) is "
                f"not a hexadecimal id of at most 15 digits: {text(c + 1 + INT_FEATURES)!r}"
            )
    keep = np.flatnonzero(line_ok)
    out = np.empty(len(keep), dtype=dtype)
    out["label"] = ints[keep, 0]
    out["dense"] = dense[keep]
    kept_ids = ids[keep]
    if sizes is not None:
        kept_ids = kept_ids % sizes
    out["sparse"] = kept_ids
    return Parsed(out, bad, n, reasons)
