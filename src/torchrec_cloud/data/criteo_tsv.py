"""Criteo's TSV, an input format of the one preprocessor (:mod:`~torchrec_cloud.data.preprocess`):
``torchrec-cloud data preprocess --format kaggle|terabyte`` (``--format`` names the built-in
schema ``criteo`` and how its splits are cut)::

    torchrec-cloud data preprocess --format kaggle --input train.txt --output /data/kaggle \\
        --num_embeddings 10000000
    torchrec-cloud data preprocess --format terabyte --input s3://raw/day_{0..23}.gz \\
        --output s3://bucket/criteo-1tb --num_embeddings_per_feature 40000000,39060,...

What is Criteo's own here: how the lines are read (plain files cut into byte ranges,
``--chunk_mb``, so that one big file like Kaggle's 11 GB ``train.txt`` is converted by every
core; gzip files start to end), how a block of lines becomes records
(:mod:`~torchrec_cloud.data.criteo_parse`, vectorised, into the record of
:mod:`~torchrec_cloud.data.criteo_format`), each task's shards committed by their ``.done``
markers (a rerun converts only what is missing), and the splits' rule (Kaggle's last 1/7 by
row count, the 1TB last day in half) as rows per split of each shard. The run, its plan, its
worker processes and the manifest are the one preprocessor's (:func:`~torchrec_cloud.data.preprocess.preprocess`).

No counting pass: ids are taken modulo the table sizes, and the one statistic TorchRec's
dense transform needs, each input file's smallest integer, is counted as the rows are
converted (a marker's ``dense_min``), so the conversion stays one pass.

A bad line (wrong number of fields, a non-integer dense value, a non-hex id, a label
other than 0/1) stops the run with ``FILE:LINE: what is wrong`` and exit code 1, or with
``--on_bad_line skip`` is left out and counted.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import re
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from torchrec_cloud import checksum, storage
from torchrec_cloud.data.conversion import read_record
from torchrec_cloud.data.criteo_format import DENSE_NAMES, SHARD_DIR, SPARSE_NAMES, record_dtype, sparse_dtype_for
from torchrec_cloud.data.criteo_parse import BadLineError, PreprocessError, parse_block
from torchrec_cloud.data.dataset import FORMAT_NAME, FORMAT_VERSION, record_section
from torchrec_cloud.data.schema import criteo_schema
from torchrec_cloud.untrusted import (
    MAX_FILE_BYTES,
    MAX_LINE_BYTES,
    MAX_ROWS,
    Fields,
    UntrustedInputError,
    integer,
    read_line,
    shown,
    text,
)

# Kaggle's train.txt is 7 days of logs; as in the references the last 1/7 is held out and
# split in half (validation, then test).
KAGGLE_HELD_OUT_FRACTION_DENOMINATOR = 7
_READ_BLOCK = 2 << 20


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
            skipped = _read_line(f, path)
            pos = start - 1 + len(skipped)
        while pos < end:
            block = f.read(min(_READ_BLOCK, max(end - pos, 1)))
            if not block:
                return
            if not block.endswith(b"\n"):
                block += _read_line(f, path)
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
                    if len(data) > MAX_LINE_BYTES:  # a file without newlines, or a gzip bomb of one line
                        raise PreprocessError(_long_line(path))
                    carry = data
                    continue
                carry = data[cut + 1 :]
                yield data[: cut + 1]
    finally:
        raw.close()


def _long_line(path: str) -> str:
    return f"{path}: a line is longer than {MAX_LINE_BYTES} bytes (no newline): not a Criteo TSV file"


def _read_line(f: Any, path: str) -> bytes:
    """The rest of a line, at most :data:`MAX_LINE_BYTES` of it (a file without newlines would
    otherwise be read whole into memory)."""
    try:
        return read_line(f, MAX_LINE_BYTES, path)
    except UntrustedInputError:
        raise PreprocessError(_long_line(path)) from None


def line_blocks(path: str) -> Iterator[bytes]:
    """Blocks of whole lines of one input file, plain or gzip, from start to end."""
    return _gzip_lines(path) if _is_gzip(path) else _range_blocks(path, 0, storage.size(path))


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
        return sparse_dtype_for(self.num_embeddings_per_feature)

    def plan(self) -> dict[str, Any]:
        """What finished shards depend on. The bad-line policy is not part of it: shards
        committed before a run stopped at a bad line are as good for a rerun with
        ``--on_bad_line skip``."""
        d = asdict(self)
        d.pop("output")
        d.pop("on_bad_line")
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "schema": "criteo", **d}


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

    def finish(self, task: Task, shard: int, first_line: Optional[int]) -> dict:
        records = np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype)
        name = _shard_name(self.opts, task.source, shard)
        target = storage.join(self.opts.output, SHARD_DIR, name)
        data = records.tobytes()
        if len(records):
            storage.write_bytes(target, data)
        marker = {
            "shard": name,
            "source": task.source,
            "index": shard,
            "rows": int(len(records)),
            "bytes": len(data),
            checksum.ALGORITHM: checksum.digest(data),
            "lines": self.lines,
            "first_line": first_line,
            "start": task.start if task.kind == "range" else None,
            "skipped": self.skipped,
            "skipped_examples": self.examples,
            "dense_min": self.dense_min,
        }
        storage.write_bytes(target + ".done", json.dumps(marker).encode())
        return marker


def _marker_path(opts: Options, source: int, shard: int) -> str:
    return storage.join(opts.output, SHARD_DIR, _shard_name(opts, source, shard) + ".done")


def _load_marker(opts: Options, source: int, shard: int) -> Optional[dict]:
    """The ``.done`` marker of a committed shard, checked to be that shard's (its name, source
    and index) with counts in range: a marker from elsewhere never names another file."""
    path = _marker_path(opts, source, shard)
    try:
        marker = read_record(path)
    except storage.StorageNotFoundError:
        return None
    try:
        doc = Fields(marker, path)
        doc.text("shard", choices=(_shard_name(opts, source, shard),))
        doc.int("source", lo=source, hi=source)
        doc.int("index", lo=shard, hi=shard)
        rows = doc.int("rows", hi=MAX_ROWS)
        row_bytes = record_dtype(opts.sparse_dtype).itemsize
        doc.int("bytes", lo=rows * row_bytes, hi=rows * row_bytes, optional=True)
        doc.text(checksum.ALGORITHM, max_len=64, optional=True)
        for key in ("lines", "skipped"):
            doc.int(key, hi=MAX_ROWS)
        for key in ("first_line", "start"):
            doc.int(key, hi=MAX_FILE_BYTES, optional=True)
        doc.int("dense_min", lo=-(2**31), hi=2**31 - 1, optional=True)
        for i, example in enumerate(doc.list("skipped_examples", 5)):
            if not isinstance(example, list) or len(example) != 2:
                raise UntrustedInputError(path, f"skipped_examples[{i}]", f"must be [line, reason], got {shown(example)}")
            integer(example[0], path, f"skipped_examples[{i}]", hi=MAX_ROWS)
            text(example[1], path, f"skipped_examples[{i}]", max_len=1000)
    except UntrustedInputError as e:
        raise PreprocessError(f"{e}; delete it, or use another --output") from None
    return marker


TASKS_DIR = "_sources"


def _task_url(opts: Options, task: Task) -> str:
    return storage.join(opts.output, TASKS_DIR, f"{_source_stem(task.path)}-{task.shard:05d}.json")


def run_task(opts: Options, task: Task, report: Callable[[int], Any] = lambda rows: None) -> list[dict]:
    """Convert one task's lines to shards (skipping shards already committed), then commit
    the task by a record of its shard count (so that whichever share finds every task's
    record writes the manifest, :func:`committed_markers`); ``report`` gets the rows
    converted as they are."""
    markers = _convert_task(opts, task, report)
    storage.write_bytes(_task_url(opts, task), json.dumps({"shards": len(markers)}).encode())
    return markers


def committed_markers(opts: Options, tasks: list[Task]) -> Optional[list[dict]]:
    """Every task's shard markers, read back (each checked as its shard's), when every task
    is committed: its record there and each of its shards' markers too (a marker deleted
    since makes its task undone); None while one is not."""
    try:
        names = set(storage.listdir(storage.join(opts.output, SHARD_DIR)))
    except storage.StorageNotFoundError:
        return None
    markers = []
    for task in tasks:
        url = _task_url(opts, task)
        if not storage.exists(url):
            return None
        try:
            count = Fields(read_record(url), url).int("shards", lo=1, hi=MAX_ROWS)
        except UntrustedInputError as e:
            raise PreprocessError(f"{e}; delete it, or use another --output") from None
        first = task.shard if task.kind == "range" else 0
        for shard in range(first, first + count):
            if _shard_name(opts, task.source, shard) + ".done" not in names:
                return None
            markers.append(_load_marker(opts, task.source, shard))
    return markers


def _convert_task(opts: Options, task: Task, report: Callable[[int], Any]) -> list[dict]:
    if task.kind == "range":
        marker = _load_marker(opts, task.source, task.shard)
        if marker is not None:
            return [marker]
        conv = _Converter(opts, task.path, None)
        line_base: list[Optional[int]] = [None]

        def locate(line_in_shard: int) -> int:
            if line_base[0] is None:
                line_base[0] = _count_lines_before(task.path, _range_start(task))
            return line_base[0] + line_in_shard

        for block in _range_blocks(task.path, task.start, task.end):
            report(conv.add(block, locate))
        return [conv.finish(task, task.shard, None)]

    # A gzip file: shard k holds input lines [k * rows_per_shard, (k + 1) * rows_per_shard).
    per = opts.rows_per_shard
    markers: list[dict] = []
    shard = 0
    line = 0
    marker = _load_marker(opts, task.source, shard)
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
                report(conv.add(head, lambda i, base=base: base + i))
            line += n_head
            if line == (shard + 1) * per:
                if conv is not None:
                    marker = conv.finish(task, shard, shard * per)
                markers.append(marker)
                shard += 1
                marker = _load_marker(opts, task.source, shard)
                conv = None if marker is not None else _Converter(opts, task.path, shard * per)
    if not saw_data:
        raise PreprocessError(f"{task.path}: the file is empty (no lines after decompression)")
    if line > shard * per:
        if conv is not None:
            marker = conv.finish(task, shard, shard * per)
        markers.append(marker)
    return markers


def _range_start(task: Task) -> int:
    """Byte offset of the first line of a range task (the first line start >= start)."""
    if task.start == 0:
        return 0
    with storage.open(task.path, "rb") as f:
        f.seek(task.start - 1)
        return task.start - 1 + len(_read_line(f, task.path))


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
# What the one preprocessor's manifest needs from a Criteo run: its shards' records with
# their rows per split, its sources, its own sections.


def split_counts(dataset: str, inputs: list[str], markers: list[dict]) -> list[list[int]]:
    """Rows of train, val and test in each shard (``markers`` in row order, a shard's rows
    in that order), by the references' rule: Kaggle's train.txt is 7 days of logs, the last
    1/7 held out and split in half (validation, then test); the 1TB last day (the highest
    day number, else the last input) split in half, the other days training."""
    rows = [m["rows"] for m in markers]
    if dataset == "kaggle":
        total = sum(rows)
        held = total // KAGGLE_HELD_OUT_FRACTION_DENOMINATOR
        bounds = {m["source"]: (total - held, total - held + (held + 1) // 2, total) for m in markers}
        everything = True
    else:
        days = [re.search(r"day_(\d+)", p.rsplit("/", 1)[-1]) for p in inputs]
        last = max(range(len(days)), key=lambda i: int(days[i].group(1))) if all(days) else len(inputs) - 1  # type: ignore[union-attr]
        n = sum(m["rows"] for m in markers if m["source"] == last)
        bounds = {last: (0, (n + 1) // 2, n)}
        everything = False
    counts, pos = [], {}
    for m in markers:
        # kaggle: positions over every input together; terabyte: within the last day.
        key = None if everything else m["source"]
        lo = pos.get(key, 0)
        hi = lo + m["rows"]
        pos[key] = hi
        if m["source"] not in bounds:
            counts.append([m["rows"], 0, 0])
            continue
        cuts = (0, *bounds[m["source"]])
        counts.append([max(0, min(hi, cuts[i + 1]) - max(lo, cuts[i])) for i in range(3)])
    return counts


def shard_records(opts: Options, markers: list[dict]) -> tuple[list[dict], list[dict], list[str]]:
    """Every shard's record as the one manifest lists it (path, source, rows, bytes, checksum,
    rows per split), the sources (with their lines, skipped lines and smallest integer: TorchRec's
    dense transform subtracts it when read) and the first skipped lines, ``FILE:LINE: what``."""
    markers = sorted(markers, key=lambda m: (m["source"], m["index"]))
    entries = []
    for m, splits in zip(markers, split_counts(opts.dataset, opts.inputs, markers)):
        path = f"{SHARD_DIR}/{m['shard']}"
        size, digest = m.get("bytes"), m.get(checksum.ALGORITHM)
        if size is None or digest is None:  # a marker of an older version: the shard is read back
            size, digest = checksum.file_digest(storage.join(opts.output, *path.split("/")))
        entries.append({"path": path, "source": m["source"], "rows": m["rows"], "bytes": size,
                        checksum.ALGORITHM: digest, "splits": splits})  # fmt: skip
    sources, examples = [], []
    for i, path in enumerate(opts.inputs):
        ms = [m for m in markers if m["source"] == i]
        rows = sum(m["rows"] for m in ms)
        if rows == 0 and opts.on_bad_line == "error":
            raise PreprocessError(f"{path}: no rows (the file holds no lines)")
        # Line numbers of a range shard are known once the earlier ranges are counted.
        line = 0
        for m in ms:
            first = m["first_line"] if m["first_line"] is not None else line
            examples += [f"{path}:{first + local + 1}: {reason}" for local, reason in m["skipped_examples"]]
            line = first + m["lines"]
        mins = [m["dense_min"] for m in ms if m["dense_min"] is not None]
        skipped = sum(m["skipped"] for m in ms)  # a Criteo row is a line: both names, one count
        sources.append({"path": path, "rows": rows, "lines": line, "skipped_rows": skipped, "skipped_lines": skipped,
                        "dense_min": min(mins) if mins else 0})  # fmt: skip
    return entries, sources, examples


def manifest_sections(opts: Options) -> dict[str, Any]:
    """The manifest's sections that say Criteo: the built-in schema, its record, its features,
    and its transforms: ids modulo the table sizes; the 13 integers stored as in the TSV
    (missing = 0), ``--dense_transform`` applying when read (TorchRec's with the smallest value
    of the row's input file, ``sources[].dense_min``)."""
    return {
        "schema": criteo_schema(opts.dataset, opts.num_embeddings_per_feature),
        "record": record_section(record_dtype(opts.sparse_dtype)),
        "features": {"label": "label", "dense": DENSE_NAMES, "sparse": SPARSE_NAMES},
        "transforms": {"table_sizes": opts.num_embeddings_per_feature, "dense": "raw"},
        "created_unix": int(time.time()),
    }


def check_names(opts: Options) -> None:
    """Two inputs of the same file name would write shards of the same names."""
    stems = [_source_stem(p) for p in opts.inputs]
    if len(set(stems)) != len(stems):
        raise PreprocessError(f"two inputs have the same file name: {stems}; rename one")


def clear_unfinished(opts: Options, remove: bool = True) -> set[str]:
    """The markers found committed; with ``remove``, what a killed run left half-written
    (``.tmp-`` files) is deleted (not by a share: another share may be writing them now)."""
    storage.makedirs(storage.join(opts.output, SHARD_DIR))
    try:
        names = storage.listdir(storage.join(opts.output, SHARD_DIR))
    except storage.StorageNotFoundError:
        names = []
    for n in names:
        if remove and n.startswith(".tmp-"):
            storage.remove(storage.join(opts.output, SHARD_DIR, n))
    return {n for n in names if n.endswith(".done")}


def start_method() -> str:
    """fork where it is safe (workers need nothing the parent has not imported): only from a
    process with one thread, since a child forked while another thread (a cloud storage
    client's event loop, a test's emulator reader) holds a lock waits on that lock forever."""
    return "fork" if "fork" in mp.get_all_start_methods() and threading.active_count() == 1 else "spawn"
