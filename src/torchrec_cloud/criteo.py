"""Criteo TSV to binary shards: ``torchrec-cloud data preprocess``.

Turns the Criteo Kaggle ``train.txt`` or the Criteo 1TB day files (``day_0`` .. ``day_23``,
plain or ``.gz``) into fixed-width binary shards plus a ``manifest.json`` that the trainer
reads with ``--dataset_path`` (see :mod:`torchrec_cloud.criteo_source` and docs/data.md)::

    torchrec-cloud data preprocess --format kaggle --input train.txt --output /data/kaggle \\
        --num_embeddings 10000000
    torchrec-cloud data preprocess --format terabyte --input s3://raw/day_{0..23}.gz \\
        --output s3://bucket/criteo-1tb --num_embeddings_per_feature 40000000,39060,...
    torchrec-cloud train --preset criteo-1tb --dataset_path s3://bucket/criteo-1tb

Every input line is ``label \\t 13 integers \\t 26 hexadecimal ids`` (empty fields are
missing values). A row is stored as one little-endian record: the label, the 13 integers
as they were (missing = 0, the reader applies the log transform) and the 26 ids parsed
from hex and taken modulo the table sizes (raw, in int64, when no sizes are given).

The conversion streams: plain files are cut into byte ranges (``--chunk_mb``) and gzip
files are read start to end, so memory stays bounded whatever the input size; work is
spread over processes (``--workers``, default all cores). Each finished shard gets a
``.done`` marker, so running the same command again after an interruption converts only
what is missing; ``manifest.json`` is written last, when every shard is there.

A bad line (wrong number of fields, a non-integer dense value, a non-hex id, a label
other than 0/1) stops the run with ``FILE:LINE: what is wrong`` and exit code 1, or with
``--on_bad_line skip`` is left out and counted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

from torchrec_cloud import storage

INT_FEATURES = 13
CAT_FEATURES = 26
FIELDS = 1 + INT_FEATURES + CAT_FEATURES
DENSE_NAMES = [f"int_{i}" for i in range(INT_FEATURES)]
SPARSE_NAMES = [f"cat_{i}" for i in range(CAT_FEATURES)]
FORMAT_NAME = "torchrec-cloud-criteo-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "_plan.json"
SHARD_DIR = "shards"
# Kaggle's train.txt is 7 days of logs; as in the references the last 1/7 is held out and
# split in half (validation, then test).
KAGGLE_HELD_OUT_FRACTION_DENOMINATOR = 7
_READ_BLOCK = 2 << 20
_INT32_MAX = 2**31 - 1


def record_dtype(sparse_dtype: str) -> np.dtype:
    """One stored row: label, 13 raw integers, 26 ids (int32 or int64), little-endian."""
    return np.dtype(
        [
            ("label", "<i4"),
            ("dense", "<i4", (INT_FEATURES,)),
            ("sparse", "<i8" if sparse_dtype == "int64" else "<i4", (CAT_FEATURES,)),
        ]
    )


class PreprocessError(RuntimeError):
    """Input that cannot be converted (bad line, empty or truncated file)."""


class BadLineError(PreprocessError):
    """A malformed line; the message starts with ``FILE:LINE:``."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(
            f"{path}:{line}: {reason} (fix the line, or pass --on_bad_line skip to leave "
            "such lines out)"
        )
        self.path, self.line, self.reason = path, line, reason

    def __reduce__(self) -> Any:  # crosses process boundaries intact
        return (BadLineError, (self.path, self.line, self.reason))


# ---------------------------------------------------------------------------------------
# Parsing: a block of whole lines to records, vectorised with numpy.

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
    taken modulo ``sizes`` when given. Bad lines are left out and listed."""
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
    dense_ok = ints_ok[:, 1:] & (dense <= _INT32_MAX) & (dense >= -_INT32_MAX)
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


# ---------------------------------------------------------------------------------------
# Reading inputs as blocks of whole lines.


def _is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def _source_stem(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".gz", ".tsv", ".txt", ".csv"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "input"


def _range_blocks(path: str, start: int, end: int) -> Iterator[bytes]:
    """Whole lines whose first byte lies in ``[start, end)`` of a plain file, in blocks."""
    with storage.open(path, "rb") as f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            skipped = f.readline()
            pos = start - 1 + len(skipped)
        while pos < end:
            block = f.read(min(_READ_BLOCK, max(end - pos, 1)))
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()
            if not block.endswith(b"\n"):
                block += b"\n"  # last line of a file without a final newline
            if pos + len(block) > end:
                # Keep only lines that start before ``end``.
                cut = block.find(b"\n", max(end - pos - 1, 0))
                block = block[: cut + 1]
            pos += len(block)
            yield block


def _gzip_lines(path: str) -> Iterator[bytes]:
    """Blocks of whole lines of a gzip file, with clear errors for truncated/corrupt files."""
    raw = storage.open(path, "rb")
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as f:
            carry = b""
            while True:
                try:
                    chunk = f.read(_READ_BLOCK)
                except EOFError as e:
                    raise PreprocessError(
                        f"{path}: truncated gzip file (it ends before the end-of-stream "
                        "marker; download it again)"
                    ) from e
                except (gzip.BadGzipFile, zlib.error) as e:
                    raise PreprocessError(f"{path}: not a valid gzip file ({e})") from e
                if not chunk:
                    if carry:
                        yield carry + b"\n"
                    return
                data = carry + chunk
                cut = data.rfind(b"\n")
                if cut < 0:
                    carry = data
                    continue
                carry = data[cut + 1 :]
                yield data[: cut + 1]
    finally:
        raw.close()


def _split_lines(block: bytes, count: int) -> tuple[bytes, bytes]:
    """The first ``count`` lines of ``block`` and the rest."""
    buf = np.frombuffer(block, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    if count >= len(nl):
        return block, b""
    cut = int(nl[count - 1]) + 1 if count > 0 else 0
    return block[:cut], block[cut:]


def _count_lines_before(path: str, offset: int) -> int:
    lines = 0
    with storage.open(path, "rb") as f:
        remaining = offset
        while remaining > 0:
            chunk = f.read(min(_READ_BLOCK, remaining))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            remaining -= len(chunk)
    return lines


# ---------------------------------------------------------------------------------------
# Tasks: each converts one plain byte range or one whole gzip file to shards.


@dataclass
class Options:
    """What a preprocessing run produces; stored in the plan so a resumed run matches."""

    dataset: str
    inputs: list[str]
    input_sizes: list[int]
    output: str
    num_embeddings_per_feature: Optional[list[int]]
    on_bad_line: str
    chunk_bytes: int
    rows_per_shard: int

    @property
    def sparse_dtype(self) -> str:
        sizes = self.num_embeddings_per_feature
        return "int32" if sizes is not None and max(sizes) <= _INT32_MAX + 1 else "int64"

    def plan(self) -> dict[str, Any]:
        """What finished shards depend on. The bad-line policy is not part of it: shards
        committed before a run stopped at a bad line are as good for a rerun with
        ``--on_bad_line skip``."""
        d = asdict(self)
        d.pop("output")
        d.pop("on_bad_line")
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, **d}


@dataclass
class Task:
    source: int
    path: str
    kind: str  # "range" or "gzip"
    shard: int = 0  # first shard index of this task
    start: int = 0
    end: int = 0


def _shard_name(opts: Options, source: int, shard: int) -> str:
    return f"{_source_stem(opts.inputs[source])}-{shard:05d}.bin"


class _Converter:
    """Converts blocks of lines into one shard, counting what it keeps and skips."""

    def __init__(self, opts: Options, path: str, first_line: Optional[int]) -> None:
        self.opts = opts
        self.path = path
        self.first_line = first_line  # 0-based line number of the first line, if known
        self.dtype = record_dtype(opts.sparse_dtype)
        self.sizes = (
            np.asarray(opts.num_embeddings_per_feature, dtype=np.int64)
            if opts.num_embeddings_per_feature is not None
            else None
        )
        self.parts: list[np.ndarray] = []
        self.lines = 0
        self.skipped = 0
        self.examples: list[list[Any]] = []  # [line in shard (0-based), reason]
        self.dense_min: Optional[int] = None

    def add(self, block: bytes, locate: Any) -> int:
        parsed = parse_block(block, self.sizes, self.dtype)
        if len(parsed.bad_lines):
            first = int(parsed.bad_lines[0])
            if self.opts.on_bad_line == "error":
                raise BadLineError(self.path, locate(self.lines + first) + 1, parsed.reasons[first])
            self.skipped += len(parsed.bad_lines)
            for i in parsed.bad_lines[: max(0, 5 - len(self.examples))]:
                self.examples.append([self.lines + int(i), parsed.reasons.get(int(i), "bad line")])
        if len(parsed.records):
            self.parts.append(parsed.records)
            m = int(parsed.records["dense"].min())
            self.dense_min = m if self.dense_min is None else min(self.dense_min, m)
        self.lines += parsed.lines
        return len(parsed.records)

    def finish(self, task: Task, shard: int, first_line: Optional[int], report: Any) -> dict:
        records = np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype)
        name = _shard_name(self.opts, task.source, shard)
        target = storage.join(self.opts.output, SHARD_DIR, name)
        if len(records):
            storage.write_bytes(target, records.tobytes())
        marker = {
            "shard": name,
            "source": task.source,
            "index": shard,
            "rows": int(len(records)),
            "lines": self.lines,
            "first_line": first_line,
            "start": task.start if task.kind == "range" else None,
            "skipped": self.skipped,
            "skipped_examples": self.examples,
            "dense_min": self.dense_min,
        }
        storage.write_bytes(target + ".done", json.dumps(marker).encode())
        return marker


_progress: Any = None


def _init_worker(queue: Any) -> None:
    global _progress
    _progress = queue


def _report(rows: int) -> None:
    if _progress is not None:
        _progress.put(rows)


def _marker_path(opts: Options, source: int, shard: int) -> str:
    return storage.join(opts.output, SHARD_DIR, _shard_name(opts, source, shard) + ".done")


def _load_marker(path: str) -> Optional[dict]:
    try:
        return json.loads(storage.read_bytes(path))
    except storage.StorageNotFoundError:
        return None


def run_task(opts: Options, task: Task) -> list[dict]:
    """Convert one task's lines to shards (skipping shards already committed)."""
    if task.kind == "range":
        marker = _load_marker(_marker_path(opts, task.source, task.shard))
        if marker is not None:
            return [marker]
        conv = _Converter(opts, task.path, None)
        line_base: list[Optional[int]] = [None]

        def locate(line_in_shard: int) -> int:
            if line_base[0] is None:
                line_base[0] = _count_lines_before(task.path, _range_start(task))
            return line_base[0] + line_in_shard

        for block in _range_blocks(task.path, task.start, task.end):
            _report(conv.add(block, locate))
        return [conv.finish(task, task.shard, None, _report)]

    # A gzip file: shard k holds input lines [k * rows_per_shard, (k + 1) * rows_per_shard).
    per = opts.rows_per_shard
    markers: list[dict] = []
    shard = 0
    line = 0
    marker = _load_marker(_marker_path(opts, task.source, shard))
    conv = None if marker is not None else _Converter(opts, task.path, 0)
    saw_data = False
    for block in _gzip_lines(task.path):
        saw_data = True
        while block:
            take = per - (line - shard * per)
            head, block = _split_lines(block, take)
            n_head = head.count(b"\n")
            if conv is not None:
                base = shard * per
                _report(conv.add(head, lambda i, base=base: base + i))
            line += n_head
            if line == (shard + 1) * per:
                if conv is not None:
                    marker = conv.finish(task, shard, shard * per, _report)
                markers.append(marker)
                shard += 1
                marker = _load_marker(_marker_path(opts, task.source, shard))
                conv = None if marker is not None else _Converter(opts, task.path, shard * per)
    if not saw_data:
        raise PreprocessError(f"{task.path}: the file is empty (no lines after decompression)")
    if line > shard * per:
        if conv is not None:
            marker = conv.finish(task, shard, shard * per, _report)
        markers.append(marker)
    return markers


def _range_start(task: Task) -> int:
    """Byte offset of the first line of a range task (the first line start >= start)."""
    if task.start == 0:
        return 0
    with storage.open(task.path, "rb") as f:
        f.seek(task.start - 1)
        return task.start - 1 + len(f.readline())


def _worker(args: tuple[Options, Task]) -> list[dict]:
    return run_task(*args)


def plan_tasks(opts: Options) -> list[Task]:
    tasks: list[Task] = []
    for i, (path, size) in enumerate(zip(opts.inputs, opts.input_sizes)):
        if size == 0:
            raise PreprocessError(f"{path}: the file is empty (0 bytes)")
        if _is_gzip(path):
            tasks.append(Task(i, path, "gzip"))
            continue
        for k, start in enumerate(range(0, size, opts.chunk_bytes)):
            tasks.append(Task(i, path, "range", k, start, min(start + opts.chunk_bytes, size)))
    # Big gzip files first so that no single file finishes last alone.
    tasks.sort(key=lambda t: (t.kind != "gzip", -opts.input_sizes[t.source] if t.kind == "gzip" else 0))
    return tasks


# ---------------------------------------------------------------------------------------
# The whole run.


@dataclass
class Result:
    manifest: dict
    seconds: float
    resumed_shards: int
    already_complete: bool = False


def _splits(dataset: str, opts: Options, shards: list[dict]) -> dict[str, list[list[int]]]:
    """Row segments ``[shard, start, end)`` of each split, in the references' layout."""
    rows_by_source = [0] * len(opts.inputs)
    for s in shards:
        rows_by_source[s["source"]] += s["rows"]

    def take(lo: int, hi: int, sources: set[int]) -> list[list[int]]:
        """Rows [lo, hi) of the concatenation of ``sources``' shards."""
        out, pos = [], 0
        for k, s in enumerate(shards):
            if s["source"] not in sources:
                continue
            a, b = max(lo, pos), min(hi, pos + s["rows"])
            if a < b:
                out.append([k, a - pos, b - pos])
            pos += s["rows"]
        return out

    everything = set(range(len(opts.inputs)))
    if dataset == "kaggle":
        total = sum(rows_by_source)
        held = total // KAGGLE_HELD_OUT_FRACTION_DENOMINATOR
        train_end = total - held
        val_end = train_end + (held + 1) // 2
        return {
            "train": take(0, train_end, everything),
            "val": take(train_end, val_end, everything),
            "test": take(val_end, total, everything),
        }
    # terabyte: the last day (highest day number, else the last input) is split in half.
    days = [re.search(r"day_(\d+)", p.rsplit("/", 1)[-1]) for p in opts.inputs]
    if all(days):
        last = max(range(len(days)), key=lambda i: int(days[i].group(1)))  # type: ignore[union-attr]
    else:
        last = len(opts.inputs) - 1
    n = rows_by_source[last]
    half = (n + 1) // 2
    return {
        "train": take(0, sum(rows_by_source), everything - {last}),
        "val": take(0, half, {last}),
        "test": take(half, n, {last}),
    }


def _manifest(opts: Options, markers: list[dict]) -> dict:
    shards = sorted((m for m in markers if m["rows"] > 0), key=lambda m: (m["source"], m["index"]))
    by_source: list[list[dict]] = [[] for _ in opts.inputs]
    for m in sorted(markers, key=lambda m: (m["source"], m["index"])):
        by_source[m["source"]].append(m)
    sources, skipped_examples = [], []
    for i, ms in enumerate(by_source):
        rows = sum(m["rows"] for m in ms)
        if rows == 0 and opts.on_bad_line == "error":
            raise PreprocessError(f"{opts.inputs[i]}: no rows (the file holds no lines)")
        # Line numbers of a range shard are known once the earlier ranges are counted.
        line = 0
        for m in ms:
            first = m["first_line"] if m["first_line"] is not None else line
            for local, reason in m["skipped_examples"]:
                skipped_examples.append(f"{opts.inputs[i]}:{first + local + 1}: {reason}")
            line = first + m["lines"]
        mins = [m["dense_min"] for m in ms if m["dense_min"] is not None]
        sources.append(
            {
                "path": opts.inputs[i],
                "rows": rows,
                "lines": line,
                "skipped_lines": sum(m["skipped"] for m in ms),
                "dense_min": min(mins) if mins else 0,
            }
        )
    dtype = record_dtype(opts.sparse_dtype)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dataset": opts.dataset,
        "rows": sum(s["rows"] for s in sources),
        "skipped_lines": sum(s["skipped_lines"] for s in sources),
        "skipped_examples": skipped_examples[:20],
        "record": {
            "byte_order": "little",
            "bytes_per_row": dtype.itemsize,
            "fields": [
                {"name": "label", "dtype": "int32", "shape": []},
                {"name": "dense", "dtype": "int32", "shape": [INT_FEATURES]},
                {"name": "sparse", "dtype": opts.sparse_dtype, "shape": [CAT_FEATURES]},
            ],
        },
        "features": {"label": "label", "dense": DENSE_NAMES, "sparse": SPARSE_NAMES},
        "dense_encoding": "raw integers, missing = 0; the reader applies the log transform",
        "num_embeddings_per_feature": opts.num_embeddings_per_feature,
        "sources": sources,
        "shards": [
            {"path": f"{SHARD_DIR}/{m['shard']}", "source": m["source"], "rows": m["rows"]}
            for m in shards
        ],
        "splits": _splits(opts.dataset, opts, shards),
        "created_unix": int(time.time()),
    }


def preprocess(opts: Options, workers: int = 0, progress: bool = True) -> Result:
    """Convert ``opts.inputs`` into shards and a manifest under ``opts.output``."""
    t0 = time.perf_counter()
    storage.makedirs(opts.output)
    plan_path = storage.join(opts.output, PLAN)
    plan = opts.plan()
    if storage.exists(plan_path):
        old = json.loads(storage.read_bytes(plan_path))
        if old != plan:
            changed = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise PreprocessError(
                f"{opts.output} holds a preprocessing run with different settings "
                f"({', '.join(changed)}); use another --output or delete that one"
            )
        if storage.exists(storage.join(opts.output, MANIFEST)):
            manifest = json.loads(storage.read_bytes(storage.join(opts.output, MANIFEST)))
            return Result(manifest, time.perf_counter() - t0, len(manifest["shards"]), True)
    else:
        storage.write_bytes(plan_path, json.dumps(plan, indent=1).encode())
    storage.makedirs(storage.join(opts.output, SHARD_DIR))
    tasks = plan_tasks(opts)
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    try:
        names = storage.listdir(storage.join(opts.output, SHARD_DIR))
    except storage.StorageNotFoundError:
        names = []
    done_before = {n for n in names if n.endswith(".done")}
    for n in names:
        if n.startswith(".tmp-"):  # left by a run killed while writing a shard
            storage.remove(storage.join(opts.output, SHARD_DIR, n))

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit=" rows", unit_scale=True, desc="preprocess", dynamic_ncols=True, file=sys.stderr)
    markers: list[dict] = []
    if workers <= 1:
        global _progress

        class _Direct:
            def put(self, rows: int) -> None:
                if bar is not None:
                    bar.update(rows)

        _progress = _Direct()
        try:
            for task in tasks:
                markers.extend(run_task(opts, task))
        finally:
            _progress = None
    else:
        # fork: workers need nothing the parent has not imported, and spawning would
        # re-import the command line (torch, torchrec) in every worker.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        queue = ctx.Queue()
        with ctx.Pool(workers, initializer=_init_worker, initargs=(queue,)) as pool:
            pending = pool.map_async(_worker, [(opts, t) for t in tasks], chunksize=1)
            while True:
                while not queue.empty():
                    n = queue.get()
                    if bar is not None:
                        bar.update(n)
                if pending.ready():
                    break
                pending.wait(0.2)
            markers = [m for ms in pending.get() for m in ms]
    if bar is not None:
        bar.close()
    manifest = _manifest(opts, markers)
    if manifest["rows"] == 0:
        raise PreprocessError("no rows were converted: every line was skipped as bad")
    storage.write_bytes(storage.join(opts.output, MANIFEST), json.dumps(manifest, indent=1).encode())
    resumed = sum(1 for m in markers if m["shard"] + ".done" in done_before)
    return Result(manifest, time.perf_counter() - t0, resumed)


# ---------------------------------------------------------------------------------------
# Command line.


def _sizes(ns: argparse.Namespace) -> Optional[list[int]]:
    from torchrec_cloud.config import ConfigError

    if ns.num_embeddings is not None and ns.num_embeddings_per_feature is not None:
        raise ConfigError("num_embeddings", "give --num_embeddings or --num_embeddings_per_feature, not both")
    if ns.num_embeddings_per_feature is not None:
        sizes = [x for part in ns.num_embeddings_per_feature for x in part]
        if len(sizes) != CAT_FEATURES:
            raise ConfigError(
                "num_embeddings_per_feature",
                f"needs {CAT_FEATURES} values (one per categorical feature), got {len(sizes)}",
            )
        if min(sizes) <= 0:
            raise ConfigError("num_embeddings_per_feature", f"every value must be > 0, got {sizes}")
        return sizes
    if ns.num_embeddings is not None:
        if ns.num_embeddings <= 0:
            raise ConfigError("num_embeddings", f"must be > 0, got {ns.num_embeddings}")
        return [ns.num_embeddings] * CAT_FEATURES
    return None


def cmd_preprocess(ns: argparse.Namespace) -> int:
    from torchrec_cloud.config import ConfigError

    sizes = _sizes(ns)
    if ns.chunk_mb <= 0:
        raise ConfigError("chunk_mb", f"must be > 0, got {ns.chunk_mb}")
    if ns.rows_per_shard <= 0:
        raise ConfigError("rows_per_shard", f"must be > 0, got {ns.rows_per_shard}")
    if ns.workers < 0:
        raise ConfigError("workers", f"must be >= 0, got {ns.workers}")
    if ns.format == "terabyte" and len(ns.input) < 2:
        raise ConfigError(
            "input",
            "--format terabyte needs at least two day files: the last day is split into "
            "validation and test, the others are training data",
        )
    try:
        input_sizes = [storage.size(p) for p in ns.input]
        opts = Options(
            dataset=ns.format,
            inputs=list(ns.input),
            input_sizes=input_sizes,
            output=ns.output,
            num_embeddings_per_feature=sizes,
            on_bad_line=ns.on_bad_line,
            chunk_bytes=int(ns.chunk_mb * (1 << 20)),
            rows_per_shard=ns.rows_per_shard,
        )
        stems = [_source_stem(p) for p in opts.inputs]
        if len(set(stems)) != len(stems):
            raise PreprocessError(f"two inputs have the same file name: {stems}; rename one")
        result = preprocess(opts, workers=ns.workers, progress=not ns.no_progress)
    except (PreprocessError, storage.StorageError) as e:
        print(f"torchrec-cloud data preprocess: error: {e}", file=sys.stderr)
        return 1
    m = result.manifest
    if result.already_complete:
        print(f"{ns.output} is already complete ({m['rows']} rows in {len(m['shards'])} shards); nothing to do")
        return 0
    rate = m["rows"] / result.seconds if result.seconds > 0 else float("nan")
    print(
        f"wrote {m['rows']} rows in {len(m['shards'])} shards to {ns.output} "
        f"({result.seconds:.1f}s, {rate:,.0f} rows/s; train {sum(e - s for _, s, e in m['splits']['train'])}, "
        f"val {sum(e - s for _, s, e in m['splits']['val'])}, test {sum(e - s for _, s, e in m['splits']['test'])})"
    )
    if result.resumed_shards:
        print(f"resumed: {result.resumed_shards} shard(s) were already done and kept")
    if m["skipped_lines"]:
        print(f"skipped {m['skipped_lines']} bad line(s); first ones:")
        for line in m["skipped_examples"][:5]:
            print(f"  {line}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from torchrec_cloud.config import _int_list

    parser = subparsers.add_parser(
        "data", help="prepare Criteo data for training (preprocess TSV into binary shards)",
        description="Prepare Criteo data for --dataset_path.",
    )
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(parser))
    sub.required = True
    p = sub.add_parser(
        "preprocess",
        help="convert Criteo Kaggle/1TB TSV (plain or .gz) into binary shards + manifest",
        description="Convert Criteo Kaggle train.txt or 1TB day files (plain or .gz, local "
        "or in a bucket) into binary shards and a manifest for train --dataset_path. "
        "See docs/data.md for the format.",
    )
    p.add_argument("--format", required=True, choices=["kaggle", "terabyte"],
                   help="kaggle: train.txt (last 1/7 held out for val/test); terabyte: "
                        "day_0..day_23 (the last day split into val/test)")
    p.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_URL",
                   help="TSV files, plain or .gz, local paths or s3:// gs:// az:// URLs")
    p.add_argument("--output", required=True, metavar="DIR_OR_URL",
                   help="folder or URL for shards and manifest.json (resumes if it holds "
                        "an interrupted run with the same settings)")
    p.add_argument("--num_embeddings", type=int, default=None,
                   help="take every categorical id modulo N (table rows)")
    p.add_argument("--num_embeddings_per_feature", type=_int_list, nargs="+", default=None,
                   metavar="N,N,...", help="26 table sizes, one per categorical feature")
    p.add_argument("--on_bad_line", choices=["error", "skip"], default="error",
                   help="error: stop at the first bad line with FILE:LINE (exit 1); "
                        "skip: leave bad lines out and report how many")
    p.add_argument("--workers", type=int, default=0,
                   help="processes to use (default 0: all cores)")
    p.add_argument("--chunk_mb", type=float, default=64.0,
                   help="plain files are cut into ranges of this many MiB, one shard each")
    p.add_argument("--rows_per_shard", type=int, default=500_000,
                   help="gzip files: input lines per shard")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_preprocess)
    return parser
