"""The one preprocessor: ``torchrec-cloud data preprocess``, your own events by a schema
(``--schema FILE``) or Criteo's TSV, the built-in schema (``--format kaggle|terabyte``; its
input format in :mod:`~torchrec_cloud.data.criteo_tsv`, converted in one pass by byte ranges,
:func:`preprocess` running it with the same plan, workers and manifest as a schema's).

Parquet or CSV/TSV files (local or ``s3://``, ``gs://``, ``az://``; a folder means the
files under it) become the shards and manifest of :mod:`~torchrec_cloud.data.dataset`, through
the schema's transforms (:mod:`~torchrec_cloud.data.transforms`)::

    torchrec-cloud data preprocess --schema schema.yaml --input s3://bucket/events/ \\
        --output s3://bucket/events-shards --split_by ts --val_from 2024-03-01 --test_from 2024-03-15

Two passes over each input: counting (vocabularies, the mean and spread of ``standardize``
features and a summary of each bucketized column's values, with their positive labels, for
its boundaries (:mod:`~torchrec_cloud.data.buckets`), over training rows only; skipped when the schema needs
none of them),
then converting. Each input's counts and each shard are committed by a file of their own, so
the same command run again after an interruption does only what is missing.

Many machines (``--shares N --share_index I``, or ``JOB_COMPLETION_INDEX`` from a
Kubernetes Indexed Job): share I takes inputs I, I + N, ...; it counts them, waits for every
share's counts (``_counts/``), merges them (the same result on every share) and converts its
inputs. Whichever share sees every input converted writes the manifest; running the command
again without ``--shares`` on any machine does the same, and redoes what a lost share left
undone. ``torchrec-cloud render --job preprocess`` writes that Indexed Job
(:mod:`torchrec_cloud.deploy.manifests`), and ``rehearse --job preprocess`` runs it here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np

from torchrec_cloud import checksum, storage
from torchrec_cloud.data import conversion, criteo_tsv, vocab
from torchrec_cloud.data.criteo_parse import PreprocessError
from torchrec_cloud.data.dataset import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_SHARDS,
    MAX_VOCAB_BYTES,
    SHARD_DIR,
    VOCAB_DIR,
    Rows,
    check_shard,
    load_dataset,
    record_section,
)
from torchrec_cloud.data.buckets import Summary, boundaries, label_boundaries
from torchrec_cloud.data.conversion import PLAN, prepare, run_each  # noqa: F401 (PLAN: where a run's plan is)
from torchrec_cloud.data.criteo_format import check_manifest
from torchrec_cloud.data.schema import Schema, Split
from torchrec_cloud.data.tabular import BadRowError, Caps, Input
from torchrec_cloud.data.transforms import SPLIT_CODES, Transforms
from torchrec_cloud.errors import CommandError
from torchrec_cloud.untrusted import MAX_ROWS, Fields, UntrustedInputError, integer, number, read_json, shown
from torchrec_cloud.progress import plural

COUNTS_DIR = "_counts"
SOURCES_DIR = "_sources"
POLL_S = 2.0
# For tests only: the process that commits the shard of this name then waits (until a
# rehearsal's fault ends it): a pod lost mid-way, whatever the machine's speed. A retry finds
# that shard committed and never waits.
TEST_HOLD_ENV = "TORCHREC_CLOUD_TEST_HOLD_AFTER_SHARD"
TEST_HOLD_S = 600.0


@dataclass
class Options:
    schema: Schema
    inputs: list[str]
    output: str
    split: Optional[Split]
    on_bad_line: str = "error"
    rows_per_shard: int = 500_000
    caps: Caps = Caps()
    vocab_from: Optional[str] = None
    """A dataset this command wrote: its ids keep their rows (:mod:`~torchrec_cloud.data.vocab`)."""

    def input(self, source: int) -> Input:
        """Input ``source``, read with the caps, the split's column checked."""
        by = self.split.by if self.split is not None else ""
        column = None if by in ("", "input", "hash:") else by.removeprefix("hash:")
        return Input(self.inputs[source], self.schema, self.schema.columns_read(self.split), caps=self.caps,
                     split_column=column)  # fmt: skip

    def plan(self) -> dict[str, Any]:
        """What the output depends on, as its JSON reads back; a resumed run must match it."""
        plan = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "schema": self.schema.to_dict(),
                "inputs": self.inputs, "split": asdict(self.split) if self.split else None,
                "rows_per_shard": self.rows_per_shard}  # fmt: skip
        if self.vocab_from is not None:  # only when given: plans written before the flag stay equal
            plan["vocab_from"] = self.vocab_from
        return json.loads(json.dumps(plan))

    def needs_counts(self) -> bool:
        return any(f.mapping in ("vocab", "bucketize") for f in self.schema.sparse) or any(
            f.transform == "standardize" or f.fill == "mean" for f in self.schema.dense
        )


def stem(opts: Options, source: int) -> str:
    """The name prefix of an input's files: its position and its file name."""
    name = opts.inputs[source].rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".gz", ".parquet", ".pq", ".parq", ".csv", ".tsv", ".txt"):
        name = name.removesuffix(suffix)
    return f"{source:05d}-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "input")


def _url(opts: Options, folder: str, name: str) -> str:
    return storage.join(opts.output, folder, name)


def _checked_split(opts: Options) -> Optional[Split]:
    """The split, checked against the inputs; ``--split_by input``'s files may be named by
    their path as listed or by their file name alone."""
    from torchrec_cloud.config import ConfigError

    split = opts.split
    if split is None:
        return None
    if split.by == "input":
        resolved = []
        for flag, value in (("val_from", split.val_from), ("test_from", split.test_from)):
            found = [p for p in opts.inputs if p == value] or [p for p in opts.inputs if p.rsplit("/", 1)[-1] == value]
            if len(found) != 1:
                raise ConfigError(flag, f"--split_by input needs one of the --input files (a path or a file name), got {value!r}")
            resolved.append(found[0])
        return Split("input", *resolved)
    if split.by.startswith("hash:"):
        for flag, value in (("val_from", split.val_from), ("test_from", split.test_from)):
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError(flag, f"--split_by hash:COLUMN needs a fraction in [0, 1], got {value!r}")
    return split


# ---------------------------------------------------------------------------------------
# Reading an input, with its bad rows stopped or skipped.


class _Reader:
    """An input's rows, encoded batch by batch; bad rows stop the run or are counted."""

    def __init__(self, opts: Options, source: int, transforms: Transforms, report: Callable[[int], None]) -> None:
        self.opts, self.source, self.t, self.report = opts, source, transforms, report
        self.input = opts.input(source)
        self.skipped = 0
        self.examples: list[str] = []

    def _bad(self, where: str, reason: str) -> None:
        if self.opts.on_bad_line == "error":
            raise BadRowError(where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1]), reason)
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {reason}")

    def batches(self):
        """``(first input row, table, Encoded)`` of each batch (rows count bad ones too); bad
        rows are stopped at or counted in file order."""
        import pyarrow as pa

        seen = 0  # rows the reader left out (a CSV's wrong field count, a row over a cap) that were handled
        inp = self.input
        try:
            for first, table in inp.batches():
                enc = self.t.encode(table, self.opts.split, self.source, self.opts.inputs[self.source], first,
                                    self.opts.inputs)  # fmt: skip
                last = _line(inp.where(first + table.num_rows - 1)) if table.num_rows else 0
                bad = [(_line(inp.where(first + row)), reason) for row, reason in enc.bad.items()]
                while seen < len(inp.bad_lines) and inp.bad_lines[seen][0] <= last:
                    bad.append(inp.bad_lines[seen])
                    seen += 1
                for line, reason in sorted(bad):
                    self._bad(f"{inp.path}:{line}", reason)
                self.skipped += enc.bad_count - len(enc.bad)  # beyond the first few, counted only
                self.report(len(enc.kept))
                yield first, table, enc
            for line, reason in inp.bad_lines[seen:]:
                self._bad(f"{inp.path}:{line}", reason)
        except (TypeError, pa.ArrowNotImplementedError) as e:  # a Parquet column of a type the schema cannot read
            raise PreprocessError(f"{inp.path}: {shown(str(e), 200)} (the schema and the file disagree)") from None
        except ValueError as e:
            if isinstance(e, CommandError):  # a file's field, already named
                raise
            raise PreprocessError(f"{inp.path}: {e}") from None


def _line(where: str) -> int:
    return int(where.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------------------
# Pass 1: counts of ids and dense moments over training rows, per input.


def count_input(opts: Options, source: int, report: Callable[[int], None] = lambda n: None) -> None:
    """Count one input's training ids and dense moments into ``_counts/STEM.json``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from torchrec_cloud.data.transforms import _list_array, _numbers, _texts, int_ids

    url = _url(opts, COUNTS_DIR, stem(opts, source) + ".json")
    if storage.exists(url):
        return
    schema = opts.schema
    # Rows are encoded with empty vocabularies only to learn which are bad and which train.
    counting = Transforms(schema, {f.name: [] for f in schema.sparse if f.mapping == "vocab"},
                          {f.name: {"mean": 0.0, "std": 1.0} for f in schema.dense})  # fmt: skip
    vocab_features = [f for f in schema.sparse if f.mapping == "vocab"]
    moment_features = [f for f in schema.dense if f.transform == "standardize" or f.fill == "mean"]
    bucket_features = [f for f in schema.sparse if f.mapping == "bucketize"]
    summaries = {f.name: Summary() for f in bucket_features}
    counts: dict[str, dict] = {f.name: {} for f in vocab_features}
    moments = {f.name: [0, 0.0, 0.0] for f in moment_features}  # n, mean, M2 (Chan et al.)
    reader = _Reader(opts, source, counting, report)
    train_rows = 0
    for _, table, enc in reader.batches():
        training = enc.split == SPLIT_CODES["train"]
        train = enc.kept[training]
        train_rows += len(train)
        if not len(train):
            continue
        rows = table.take(pa.array(train))
        labels = enc.records["label"][training]
        for f in vocab_features:
            column = _texts(rows.column(f.column))
            values = pc.list_flatten(_list_array(column, f)) if f.list else column
            if pa.types.is_dictionary(values.type):
                values = values.dictionary_decode()
            values = int_ids(values, f)[0] if f.type == "int" else pc.cast(values, pa.string())
            vc = pc.value_counts(values.drop_null())
            acc = counts[f.name]
            for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                acc[v] = acc.get(v, 0) + c
        for f in bucket_features:
            summaries[f.name].add(_numbers(rows.column(f.column), f.column).values, labels)
        for f in moment_features:
            x = _numbers(rows.column(f.column), f.column).values
            x = x[~np.isnan(x)]
            if len(x):
                moments[f.name] = _merge_moments(moments[f.name], [len(x), float(x.mean()), float(((x - x.mean()) ** 2).sum())])
    doc = {
        "input": opts.inputs[source],
        "train_rows": train_rows,
        "ids": {name: {"values": list(c.keys()), "counts": list(c.values())} for name, c in counts.items()},
        "moments": moments,
        "summaries": {name: summary.to_json() for name, summary in summaries.items()},
    }
    storage.write_bytes(url, json.dumps(doc).encode())


def _merge_moments(a: list, b: list) -> list:
    n = a[0] + b[0]
    if n == 0:
        return [0, 0.0, 0.0]
    delta = b[1] - a[1]
    return [n, a[1] + delta * b[0] / n, a[2] + b[2] + delta * delta * a[0] * b[0] / n]


def merge_counts(opts: Options, previous: Optional[vocab.Previous] = None) -> tuple[vocab.Grown, dict[str, dict[str, float]],
                                                                                  dict[str, list[float]]]:  # fmt: skip
    """Every input's counts merged, in input order: the vocabularies (:func:`~torchrec_cloud.data.vocab.grow`:
    without ``previous``, ids seen at least ``min_count`` times in training rows, most frequent
    first, ties by id, at most ``num_embeddings - 1``), the dense statistics and the bucketized
    features' boundaries. The same on every share."""
    schema = opts.schema
    summaries = {f.name: Summary() for f in schema.sparse if f.mapping == "bucketize"}
    totals: dict[str, dict] = {f.name: {} for f in schema.sparse if f.mapping == "vocab"}
    moments = {f.name: [0, 0.0, 0.0] for f in schema.dense if f.transform == "standardize" or f.fill == "mean"}
    for source in range(len(opts.inputs)):
        url = _url(opts, COUNTS_DIR, stem(opts, source) + ".json")
        doc = Fields(read_json(url, MAX_VOCAB_BYTES), url)
        ids = doc.obj("ids")
        for name, acc in totals.items():
            entry = ids.obj(name)
            values = entry.list("values", 1 << 30)
            found = entry.list("counts", 1 << 30)
            if len(values) != len(found):
                raise UntrustedInputError(url, entry.path, "values and counts differ in length")
            f = next(f for f in schema.sparse if f.name == name)
            id_type = int if f.type == "int" else str  # one type: ids are sorted by value to break ties
            for v, c in zip(values, found):
                if type(v) is not id_type or type(c) is not int or c < 0:
                    raise UntrustedInputError(url, entry.path, f"an id must be {'an integer' if id_type is int else 'text'} "
                                              f"(type: {f.type}) and its count an integer >= 0, got {shown(v)}: {shown(c)}")  # fmt: skip
                acc[v] = acc.get(v, 0) + c
        got = doc.obj("moments")
        for name in moments:
            m = got.list(name, 3)
            if len(m) != 3:
                raise UntrustedInputError(url, got.field(name), f"must be [count, mean, M2], got {shown(m)}")
            m = [integer(m[0], url, got.field(name), hi=MAX_ROWS)] + [number(x, url, got.field(name)) for x in m[1:]]
            moments[name] = _merge_moments(moments[name], m)
        if summaries:
            got = doc.obj("summaries")
            for name, summary in summaries.items():
                summary.merge(*_summary(got.obj(name), summary.points))
    grown = vocab.grow(schema, totals, previous)
    stats = {}
    for name, (n, mean, m2) in moments.items():
        std = float(np.sqrt(m2 / n)) if n else 1.0
        stats[name] = {"mean": float(mean), "std": std if std > 0 else 1.0, "count": int(n)}
    bounds = {}
    for f in schema.sparse:
        if f.mapping == "bucketize":
            s = summaries[f.name]
            if f.boundaries == "label":
                bounds[f.name] = label_boundaries(s.values, s.weights, s.positives, f.num_embeddings - 1)
            else:
                bounds[f.name] = boundaries(s.values, s.weights, f.num_embeddings - 1)
    return grown, stats, bounds


def _summary(e: Fields, points: int) -> tuple[list[float], list[int], list[int]]:
    """An input's summary of a bucketized column (:class:`~torchrec_cloud.data.buckets.Summary`),
    checked: finite values, integer counts, each value's positives an integer from 0 to its count."""
    values = [number(v, e.file, f"{e.field('values')}[{i}]") for i, v in enumerate(e.list("values", 6 * points))]
    weights = e.ints("weights", 6 * points, hi=MAX_ROWS)
    positives = e.ints("positives", 6 * points, hi=MAX_ROWS)
    if not len(values) == len(weights) == len(positives):
        raise UntrustedInputError(e.file, e.path, "values, weights and positives differ in length")
    for i, (k, n) in enumerate(zip(positives, weights)):
        if k > n:
            raise UntrustedInputError(e.file, f"{e.field('positives')}[{i}]",
                                      f"more positive labels ({k}) than rows ({n}) at the value {shown(values[i])}")  # fmt: skip
    return values, weights, positives


def _vocab_bytes(name: str, values: list) -> bytes:
    return json.dumps({"feature": name, "values": values}).encode()


# ---------------------------------------------------------------------------------------
# Pass 2: rows to shards, per input.


def convert_input(opts: Options, source: int, transforms: Transforms, report: Callable[[int], None] = lambda n: None) -> None:
    """Convert one input into shards of ``rows_per_shard`` input rows each (bad rows count
    too, so a shard's rows do not depend on the bad-row policy's luck), each committed by its
    ``.done`` marker, then the input by ``_sources/STEM.json`` listing them."""
    done_url = _url(opts, SOURCES_DIR, stem(opts, source) + ".json")
    if storage.exists(done_url):
        return
    per = opts.rows_per_shard
    reader = _Reader(opts, source, transforms, report)
    entries: list[dict] = []

    def name(k: int) -> str:
        return f"{stem(opts, source)}-{k:05d}.bin"

    def committed(k: int) -> Optional[dict]:
        url = _url(opts, SHARD_DIR, name(k) + ".done")
        return _entry(opts, transforms, Fields(read_json(url, MAX_MANIFEST_BYTES), url)) if storage.exists(url) else None

    def flush(k: int, parts: list[tuple[Rows, np.ndarray]], marker: Optional[dict]) -> None:
        if marker is not None:  # committed by an earlier run
            entries.append(marker)
            return
        rows = Rows.concat([r for r, _ in parts], transforms.dtype, len(opts.schema.lists), transforms.list_dtype)
        codes = np.concatenate([c for _, c in parts]) if parts else np.zeros(0, np.int8)
        rows = rows.take(np.argsort(codes, kind="stable"))  # train, then val, then test rows
        data = rows.pack()
        entry = {"path": f"{SHARD_DIR}/{name(k)}", "source": source, "rows": len(rows), "bytes": len(data),
                 checksum.ALGORITHM: checksum.digest(data), "values": [int(o[-1]) for o, _ in rows.lists],
                 "splits": [int((codes == c).sum()) for c in range(3)]}  # fmt: skip
        if len(rows):
            storage.write_bytes(_url(opts, SHARD_DIR, name(k)), data)
        storage.write_bytes(_url(opts, SHARD_DIR, name(k) + ".done"), json.dumps(entry).encode())
        entries.append(entry)
        if os.environ.get(TEST_HOLD_ENV) == name(k):
            time.sleep(TEST_HOLD_S)  # killed meanwhile, as a pod lost mid-way

    shard, parts, marker = 0, [], committed(0)
    for first, table, enc in reader.batches():
        lo, n = 0, table.num_rows
        while lo < n:
            k = (first + lo) // per
            if k != shard:
                flush(shard, parts, marker)
                shard, parts, marker = k, [], committed(k)
            hi = min(n, (k + 1) * per - first)
            if marker is None:
                where = np.flatnonzero((enc.kept >= lo) & (enc.kept < hi))
                parts.append((Rows(enc.records, enc.lists).take(where), enc.split[where]))
            lo = hi
    flush(shard, parts, marker)
    doc = {"input": opts.inputs[source], "shards": entries, "skipped_rows": reader.skipped,
           "skipped_examples": reader.examples}  # fmt: skip
    storage.write_bytes(done_url, json.dumps(doc).encode())


def _entry(opts: Options, t: Transforms, e: Fields) -> dict:
    """A shard's record (a ``.done`` marker, or an entry of an input's record), checked as a
    manifest's shards are (:func:`~torchrec_cloud.data.dataset.check_shard`), with its rows
    per split."""
    shard = check_shard(e, opts.output, t.dtype.itemsize, len(opts.schema.lists), t.list_dtype.itemsize, len(opts.inputs))
    splits = e.ints("splits", 3, hi=MAX_ROWS)
    if sum(splits) != shard.rows or len(splits) != 3:
        raise UntrustedInputError(e.file, e.field("splits"), f"must count the {shard.rows} rows of train, val and test")
    return e.data


# ---------------------------------------------------------------------------------------
# The manifest, from every input's record.


def write_manifest(opts: Options, transforms: Transforms, vocab_entries: dict, stats: dict,
                   vocabulary: Optional[dict] = None) -> Optional[dict]:  # fmt: skip
    """The manifest, written once every input is converted (None while some are not)."""
    docs = []
    for source in range(len(opts.inputs)):
        url = _url(opts, SOURCES_DIR, stem(opts, source) + ".json")
        if not storage.exists(url):
            return None
        record = Fields(read_json(url, MAX_MANIFEST_BYTES), url)
        doc = record.data
        doc["shards"] = [_entry(opts, transforms, record.at(f"shards[{i}]", e)) for i, e in enumerate(record.list("shards", MAX_SHARDS))]
        record.int("skipped_rows", hi=MAX_ROWS)
        doc["skipped_examples"] = [shown(x, 300) for x in record.list("skipped_examples", 5)]
        docs.append(doc)
    records, sources, examples = [], [], []
    for source, doc in enumerate(docs):
        shards = [{key: e[key] for key in ("path", "source", "rows", "bytes", checksum.ALGORITHM, "values", "splits")}
                  for e in doc["shards"]]  # fmt: skip
        records += shards
        sources.append({"path": opts.inputs[source], "rows": sum(e["rows"] for e in shards),
                        "skipped_rows": doc["skipped_rows"]})  # fmt: skip
        examples += doc["skipped_examples"]
    sections = {
        "schema": opts.schema.to_dict(),
        "record": record_section(transforms.dtype, list_dtype=transforms.list_dtype.name,
                                 lists=[f.name for f in opts.schema.lists]),  # fmt: skip
        "features": {
            "label": opts.schema.label.column,
            "dense": [f.name for f in opts.schema.dense],
            "sparse": [f.name for f in opts.schema.sparse],
            "pooling": [f.pooling for f in opts.schema.sparse],
        },
        "transforms": {"table_sizes": transforms.table_sizes, "vocab": vocab_entries,
                       "dense_stats": {k: {"mean": v["mean"], "std": v["std"]} for k, v in stats.items()},
                       "boundaries": {k: v.tolist() for k, v in transforms.boundaries.items()}},  # fmt: skip
        "split": asdict(opts.split) if opts.split else None,
        vocab.SECTION: vocabulary,
    }
    return conversion.write_manifest(opts.output, sections, records, sources, examples)


# ---------------------------------------------------------------------------------------
# The whole run, or one share of it.


@dataclass
class Result:
    manifest: Optional[dict]
    seconds: float
    already_complete: bool = False
    converted: int = 0  # inputs converted by this run
    resumed: int = 0  # shards found committed by an earlier run (Criteo's TSV)


def _prepare(opts: Options) -> Optional[dict]:
    """Check or write the plan; the finished manifest when there is one."""
    return prepare(opts.output, opts.plan(), lambda m: load_dataset(opts.output, m, check_files=False).manifest)


def _wait_for_counts(opts: Options, wait_s: float) -> None:
    """Until every input's counts are there (other shares write theirs)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            names = set(storage.listdir(storage.join(opts.output, COUNTS_DIR)))
        except storage.StorageNotFoundError:
            names = set()
        missing = [i for i in range(len(opts.inputs)) if stem(opts, i) + ".json" not in names]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PreprocessError(f"waited {wait_s:.0f}s for the counts of {plural(len(missing), 'input')} "
                                  f"(first: {opts.inputs[missing[0]]}); run the shares that hold them")  # fmt: skip
        time.sleep(POLL_S)


def _run(fn: Callable, opts: Options, sources: list[int], extra: tuple, workers: int, progress: Any) -> None:
    # spawn: pyarrow's own threads make a forked child unsafe.
    run_each(fn, opts, sources, extra, workers, progress, "spawn")


def preprocess(opts: Options | criteo_tsv.Options, workers: int = 1, share: Optional[tuple[int, int]] = None,
               wait_s: float = 3600.0, progress: Any = None) -> Result:  # fmt: skip
    """Preprocess ``opts.inputs`` (or share ``share = (index, count)`` of them) into
    ``opts.output``; the manifest is written by whichever run finds every input converted.
    ``opts``: a schema's inputs, or Criteo's TSV (:class:`~torchrec_cloud.data.criteo_tsv.Options`,
    the built-in schema: its shares are shares of its tasks, byte ranges and gzip files)."""
    from torchrec_cloud.progress import Progress

    t0 = time.perf_counter()
    progress = progress or Progress("preprocess", "rows", enabled=False)
    if isinstance(opts, criteo_tsv.Options):
        return _preprocess_tsv(opts, workers, share, progress, t0)
    opts = dataclasses.replace(opts, split=_checked_split(opts))
    # PREV is checked before anything is written: a refused one leaves no run to resume.
    previous = vocab.load_previous(opts.vocab_from, opts.schema) if opts.vocab_from is not None else None
    done = _prepare(opts)
    if done is not None:
        return Result(done, time.perf_counter() - t0, True)
    mine = list(range(len(opts.inputs)))
    if share is not None:
        index, count = share
        mine = mine[index::count]
    for s in mine:  # a column missing from a file stops the run before any work
        checked = opts.input(s)
        checked.check_columns()
        checked.check_types()
    stats: dict[str, dict] = {}
    bounds: dict[str, list[float]] = {}
    if opts.needs_counts():
        _run(count_input, opts, mine, (), workers, progress)
        _wait_for_counts(opts, wait_s if share is not None else 0.0)
        grown, stats, bounds = merge_counts(opts, previous)
    else:  # no vocabulary: the lineage only
        grown = vocab.grow(opts.schema, {}, previous)
    vocabularies = grown.vocabularies
    vocab_entries = {}
    for name, values in vocabularies.items():
        data = _vocab_bytes(name, values)
        url = _url(opts, VOCAB_DIR, f"{name}.json")
        if not storage.exists(url):
            storage.write_bytes(url, data)
        vocab_entries[name] = {"path": f"{VOCAB_DIR}/{name}.json", "bytes": len(data),
                               checksum.ALGORITHM: checksum.digest(data), "size": len(values)}  # fmt: skip
    transforms = Transforms(opts.schema, vocabularies, stats, bounds)
    todo = [s for s in mine if not storage.exists(_url(opts, SOURCES_DIR, stem(opts, s) + ".json"))]
    _run(convert_input, opts, todo, (transforms,), workers, progress)
    progress.close()
    counts = vocab.write_counts(opts.output, grown)
    section = vocab.section(opts.schema, {"vocab": vocab_entries}, grown, counts, previous)
    manifest = write_manifest(opts, transforms, vocab_entries, stats, section)
    return Result(manifest, time.perf_counter() - t0, False, len(todo))


def _preprocess_tsv(opts: criteo_tsv.Options, workers: int, share: Optional[tuple[int, int]], progress: Any,
                    t0: float) -> Result:  # fmt: skip
    """Criteo's TSV: no counting pass (ids modulo the table sizes; each file's smallest
    integer counted as its rows are converted); its tasks (byte ranges of a plain file, whole
    gzip files; share I of N takes tasks I, I + N, ...) converted in parallel, each shard
    committed by its marker, each task by its record."""
    criteo_tsv.check_names(opts)
    done = prepare(opts.output, opts.plan(), lambda m: check_manifest(m, opts.output))
    if done is not None:
        return Result(done, time.perf_counter() - t0, True, resumed=len(done["shards"]))
    committed = criteo_tsv.clear_unfinished(opts, remove=share is None)
    tasks = criteo_tsv.plan_tasks(opts)
    mine = tasks if share is None else tasks[share[0]::share[1]]
    workers = min(workers or os.cpu_count() or 1, max(len(mine), 1))
    results = run_each(criteo_tsv.run_task, opts, mine, (), workers, progress, criteo_tsv.start_method())
    progress.close()
    markers = [m for ms in results for m in ms]
    resumed = sum(1 for m in markers if m["shard"] + ".done" in committed)
    if share is not None:  # every share's tasks, once all are committed
        every = criteo_tsv.committed_markers(opts, tasks)
        if every is None:
            return Result(None, time.perf_counter() - t0, False, len(mine), resumed)
        markers = every
    records, sources, examples = criteo_tsv.shard_records(opts, markers)
    manifest = conversion.write_manifest(opts.output, criteo_tsv.manifest_sections(opts), records, sources, examples,
                                         "skipped_lines")  # fmt: skip
    return Result(manifest, time.perf_counter() - t0, False, len(mine), resumed)
