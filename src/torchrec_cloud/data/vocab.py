"""Vocabularies that grow from day to day: ``data preprocess --vocab_from PREV``::

    torchrec-cloud data preprocess --schema schema.yaml --input day_1.parquet \\
        --vocab_from /data/day_0 --output /data/day_1

A ``mapping: vocab`` feature maps an id to row ``1 + its place in the vocabulary`` (row 0:
every id not in it). Built from scratch each day, the rows follow the day's frequencies and
yesterday's weights mean nothing for today's ids. With ``--vocab_from`` the vocabulary of
PREV (a dataset ``data preprocess`` wrote) is the start:

- every id of PREV's vocabulary keeps its row;
- an id not in it is admitted once its count reaches the feature's ``min_count``: counts are
  PREV's stored counts plus today's training rows' (no decay), so an id seen once a day is
  admitted on the day its total reaches ``min_count``;
- admitted ids take the rows after the last one used, up to the table's capacity
  (``num_embeddings - 1`` ids, row 0 stays the unknown row);
- a full table evicts to make room: first ids unseen for ``evict_after`` generations (the
  feature's schema field; a generation, a "day", is one ``--vocab_from`` step: a dataset's
  ``version``), stalest first; then the least frequent, but only for a newcomer counted more
  often than the id it replaces. The freed row goes to the newcomer and is listed in the
  manifest's ``vocabulary.reset_rows`` (its weights and optimizer state must start afresh).
  Rows after PREV's last one are new rows of a table that grew, never listed.

What the next day needs (each admitted id's count and the generation it was last seen in
training rows; ids counted but not admitted yet, at most ``num_embeddings`` of them, dropped
once unseen for ``evict_after`` generations) is stored beside each vocabulary as
``vocab/NAME.counts.json``, recorded with its size and checksum in the manifest's
``vocabulary.counts``, and read back as untrusted input (capped, checksummed, every field
checked). ``hash``, ``modulo`` and ``bucketize`` features need none of this.

The manifest's ``vocabulary`` section (:func:`vocabulary_section`) is what a warm start checks a
dataset's lineage with: ``version`` (0 without ``--vocab_from``), ``digest`` (of every feature's
id-to-row map: the vocabularies' checksums, the other features' mappings and sizes),
``parent`` (PREV's digest), ``ancestors`` (every earlier version's digest, oldest first) and
``reset_rows``. docs/daily.md explains the loop.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

from torchrec_cloud import checksum, storage
from torchrec_cloud.data.criteo_parse import PreprocessError
from torchrec_cloud.data.dataset import (
    MANIFEST,
    MAX_VOCAB_BYTES,
    VOCAB_DIR,
    is_schema_dataset,
    load_dataset,
    read_manifest,
    read_vocabularies,
)
from torchrec_cloud.data.schema import Schema, Sparse, parse_schema
from torchrec_cloud.untrusted import Fields, UntrustedInputError, local_member, parse_json, read_capped, shown

SECTION = "vocabulary"
COUNTS_SUFFIX = ".counts.json"
MAX_VERSION = 1 << 20
"""The most generations a lineage records (a daily job runs for 2,800 years first)."""
MAX_COUNT = 1 << 62
_HEX = set("0123456789abcdef")


@dataclass
class State:
    """One feature's vocabulary and counts: ``ids[i]`` holds row ``i + 1``."""

    ids: list
    counts: list[int]
    seen: list[int]  # the generation each id was last seen in training rows
    pending: dict = field(default_factory=dict)  # id -> [count, last seen]: counted, not admitted


@dataclass
class Previous:
    """PREV, read and checked: its lineage and each vocab feature's state."""

    path: str
    section: dict
    states: dict[str, State]


@dataclass
class Grown:
    """Today's vocabularies and what the manifest and the next day need."""

    version: int
    states: dict[str, State]
    reset_rows: dict[str, list[int]]

    @property
    def vocabularies(self) -> dict[str, list]:
        return {name: s.ids for name, s in self.states.items()}


# ---------------------------------------------------------------------------------------
# Growing: from PREV's state and today's counts.


def grow(schema: Schema, totals: dict[str, dict], previous: Optional[Previous]) -> Grown:
    """Each vocab feature's vocabulary from today's training counts (``totals``: feature ->
    id -> count) and, with ``previous``, PREV's state (module docstring). Without it: ids
    counted at least ``min_count`` times, most frequent first, ties by id, as many as fit. The
    same result on every share."""
    version = 0 if previous is None else previous.section["version"] + 1
    states, reset = {}, {}
    for f in schema.sparse:
        if f.mapping != "vocab":
            continue
        today = totals[f.name]
        if previous is None:
            kept = sorted(((c, v) for v, c in today.items() if c >= f.min_count), key=lambda cv: (-cv[0], cv[1]))
            kept = kept[: f.num_embeddings - 1]
            admitted = {v for _, v in kept}
            pending = {v: [c, 0] for v, c in today.items() if v not in admitted}
            state = State([v for _, v in kept], [c for c, _ in kept], [0] * len(kept), pending)
        else:
            state, reset[f.name] = _grow_one(f, previous.states[f.name], today, version)
        _prune(f, state, version)
        states[f.name] = state
    return Grown(version, states, {k: v for k, v in reset.items() if v})


def _grow_one(f: Sparse, prev: State, today: dict, version: int) -> tuple[State, list[int]]:
    rows = {v: i for i, v in enumerate(prev.ids)}
    s = State(list(prev.ids), list(prev.counts), list(prev.seen), {k: list(v) for k, v in prev.pending.items()})
    for v, c in today.items():
        if v in rows:
            s.counts[rows[v]] += c
            s.seen[rows[v]] = version
        else:
            entry = s.pending.setdefault(v, [0, version])
            entry[0] += c
            entry[1] = version
    candidates = sorted((v for v, (c, _) in s.pending.items() if c >= f.min_count), key=lambda v: (-s.pending[v][0], v))
    free = max(0, f.num_embeddings - 1 - len(s.ids))
    for v in candidates[:free]:
        c, seen = s.pending.pop(v)
        s.ids.append(v)
        s.counts.append(c)
        s.seen.append(seen)
    stale = [i for i in range(len(prev.ids)) if f.evict_after is not None and version - s.seen[i] >= f.evict_after]
    stale.sort(key=lambda i: (s.seen[i], s.counts[i], i))
    fresh = sorted(set(range(len(prev.ids))) - set(stale), key=lambda i: (s.counts[i], s.seen[i], i))
    victims = [(i, True) for i in stale] + [(i, False) for i in fresh]
    reset = []
    for v, (i, is_stale) in zip(candidates[free:], victims):
        c, seen = s.pending[v]
        if not is_stale and c <= s.counts[i]:
            break  # newcomers come most counted first, victims least counted first: none further wins
        del s.pending[v]
        s.ids[i], s.counts[i], s.seen[i] = v, c, seen
        reset.append(i + 1)
    return s, sorted(reset)


def _prune(f: Sparse, s: State, version: int) -> None:
    """Ids counted but not admitted: those unseen for ``evict_after`` generations dropped, the
    most counted ``num_embeddings`` kept (what the next day reads stays bounded)."""
    items = [(v, c, seen) for v, (c, seen) in s.pending.items() if f.evict_after is None or version - seen < f.evict_after]
    items.sort(key=lambda e: (-e[1], -e[2], e[0]))
    s.pending = {v: [c, seen] for v, c, seen in items[: f.num_embeddings]}


# ---------------------------------------------------------------------------------------
# Stored with the dataset: vocab/NAME.counts.json, recorded in the manifest.


def counts_bytes(name: str, version: int, s: State) -> bytes:
    return json.dumps({"feature": name, "version": version, "counts": s.counts, "seen": s.seen,
                       "pending": {"values": list(s.pending), "counts": [c for c, _ in s.pending.values()],
                                   "seen": [seen for _, seen in s.pending.values()]}}).encode()  # fmt: skip


def write_counts(output: str, grown: Grown) -> dict[str, dict]:
    """Each feature's counts file under ``output/vocab/`` (written once: every share writes the
    same bytes); their entries for the manifest."""
    entries = {}
    for name, s in grown.states.items():
        data = counts_bytes(name, grown.version, s)
        path = f"{VOCAB_DIR}/{name}{COUNTS_SUFFIX}"
        url = storage.join(output, VOCAB_DIR, name + COUNTS_SUFFIX)
        if not storage.exists(url):
            storage.write_bytes(url, data)
        entries[name] = {"path": path, "bytes": len(data), checksum.ALGORITHM: checksum.digest(data)}
    return entries


def section(schema: Schema, transforms: dict, grown: Grown, counts: dict[str, dict], previous: Optional[Previous]) -> dict:
    """The manifest's ``vocabulary`` section of a dataset with these ``transforms`` (the
    manifest's section of that name)."""
    parent = None if previous is None else previous.section["digest"]
    ancestors = [] if previous is None else previous.section["ancestors"] + [parent]
    return {"version": grown.version, "digest": digest(schema, transforms), "parent": parent, "ancestors": ancestors,
            "reset_rows": grown.reset_rows, "counts": counts}  # fmt: skip


def digest(schema: Schema, transforms: dict) -> str:
    """SHA-256 of every sparse feature's id-to-row map: a vocab feature's by its vocabulary
    file's checksum and size (the ids in row order), the others' by their mapping, id type and
    table size. Datasets whose ids land on the same rows share it, whatever their rows, split
    or dense statistics."""
    vocab = transforms.get("vocab") or {}
    maps = []
    for f in schema.sparse:
        if f.mapping == "vocab":
            e = vocab.get(f.name) or {}
            maps.append([f.name, f.type, f.list, "vocab", e.get(checksum.ALGORITHM), e.get("size")])
        elif f.mapping == "bucketize":
            maps.append([f.name, f.type, f.list, f.mapping])  # boundaries are the day's: a number, not an id
        else:
            maps.append([f.name, f.type, f.list, f.mapping, f.num_embeddings])
    return hashlib.sha256(json.dumps(maps, separators=(",", ":")).encode()).hexdigest()


def vocabulary_section(manifest: dict, where: str = MANIFEST) -> dict:
    """A dataset's ``vocabulary`` section (version, digest, parent, ancestors, reset_rows,
    counts), checked; for a manifest written before datasets recorded one, version 0 with the
    digest of its vocabularies. One line naming ``where`` and the field when it is not what
    this writer writes (its digest must be that of the manifest's vocabularies)."""
    if not is_schema_dataset(manifest):  # Criteo's layout: ids modulo the table sizes, never grown
        sizes = manifest.get("num_embeddings_per_feature") if isinstance(manifest, dict) else None
        d = hashlib.sha256(json.dumps({"criteo": sizes}).encode()).hexdigest()
        return {"version": 0, "digest": d, "parent": None, "ancestors": [], "reset_rows": {}, "counts": {}}
    schema = parse_schema(manifest.get("schema"), f"{where} (schema)")
    expected = digest(schema, manifest.get("transforms") or {})
    if manifest.get(SECTION) is None:
        return {"version": 0, "digest": expected, "parent": None, "ancestors": [], "reset_rows": {}, "counts": {}}
    v = Fields(manifest[SECTION], where, SECTION)
    version = v.int("version", hi=MAX_VERSION)
    got = _hex(v, "digest")
    if got != expected:
        raise UntrustedInputError(where, v.field("digest"), "is not the digest of this dataset's vocabularies (altered manifest)")
    ancestors = v.list("ancestors", MAX_VERSION)
    if len(ancestors) != version:
        raise UntrustedInputError(where, v.field("ancestors"), f"must list the {version} earlier versions' digests")
    ancestors = [_hex(v.at(f"ancestors[{i}]", {"d": a}), "d") for i, a in enumerate(ancestors)]
    parent = None if version == 0 else _hex(v, "parent")
    if version == 0 and v.has("parent"):
        raise UntrustedInputError(where, v.field("parent"), "must be null for version 0")
    if parent is not None and ancestors[-1] != parent:
        raise UntrustedInputError(where, v.field("ancestors"), "must end with the parent's digest")
    vocab_features = {f.name: f for f in schema.sparse if f.mapping == "vocab"}
    reset_rows = {}
    for name, rows in v.mapping("reset_rows", len(schema.sparse)).items():
        if name not in vocab_features:
            raise UntrustedInputError(where, v.field(f"reset_rows.{shown(name)}"), "is not a vocab feature of the schema")
        n = vocab_features[name].num_embeddings
        reset_rows[name] = v.obj("reset_rows").ints(name, n, lo=1, hi=n - 1)
    counts = {}
    raw = v.obj("counts", optional=True)
    for name in (raw.data if raw is not None else {}):
        if name not in vocab_features:
            raise UntrustedInputError(where, raw.field(shown(name)), "is not a vocab feature of the schema")
        e = raw.obj(name)
        counts[name] = {"path": e.name("path", parts=2), "bytes": e.int("bytes", lo=1, hi=MAX_VOCAB_BYTES),
                        checksum.ALGORITHM: e.text(checksum.ALGORITHM, max_len=64)}  # fmt: skip
    return {"version": version, "digest": got, "parent": parent, "ancestors": ancestors, "reset_rows": reset_rows,
            "counts": counts}  # fmt: skip


def _hex(v: Fields, key: str) -> str:
    d = v.text(key, 64)
    if len(d) != 64 or not set(d) <= _HEX:
        raise UntrustedInputError(v.file, v.field(key), f"must be 64 hex digits, got {shown(d)}")
    return d


# ---------------------------------------------------------------------------------------
# Reading PREV.


def load_previous(path: str, schema: Schema) -> Previous:
    """PREV (``--vocab_from``): its manifest, vocabularies and counts, checked as untrusted
    input, and its schema checked against ``schema`` (the same features and mappings; a
    vocab table may grow, never shrink below PREV's vocabulary). One line otherwise."""
    from torchrec_cloud.config import ConfigError

    try:
        manifest = read_manifest(path)
    except ConfigError as e:
        raise ConfigError("vocab_from", str(e).removeprefix(f"--{e.flag}: ")) from None
    if not is_schema_dataset(manifest):
        raise ConfigError("vocab_from", f"{path} is not a dataset made by data preprocess --schema "
                          "(Criteo's ids are taken modulo the table sizes and need no vocabulary)")  # fmt: skip
    url = storage.join(path, MANIFEST)
    ds = load_dataset(path, manifest, check_files=False)
    sec = vocabulary_section(manifest, url)
    _compatible(ds.schema, schema, path, ds.vocab_files)
    vocabularies = read_vocabularies(path, ds.vocab_files, url)
    states = {}
    for f in schema.sparse:
        if f.mapping != "vocab":
            continue
        ids = list(vocabularies[f.name])
        entry = sec["counts"].get(f.name)
        if entry is None:  # written before datasets kept their counts: each id counted as just admitted
            states[f.name] = State(ids, [f.min_count] * len(ids), [sec["version"]] * len(ids), {})
        else:
            states[f.name] = _read_counts(path, entry, f, ids, sec["version"])
    return Previous(path, sec, states)


def _compatible(old: Schema, new: Schema, path: str, vocab_files: dict) -> None:
    def refuse(what: str) -> None:
        raise PreprocessError(f"--vocab_from {path}: its schema differs from --schema: {what}; give a dataset "
                              "preprocessed with the same features (or start a new lineage without --vocab_from)")  # fmt: skip

    if [f.name for f in old.dense] != [f.name for f in new.dense]:
        refuse(f"dense features {shown([f.name for f in old.dense])} there, {shown([f.name for f in new.dense])} here")
    if [f.name for f in old.sparse] != [f.name for f in new.sparse]:
        refuse(f"sparse features {shown([f.name for f in old.sparse])} there, {shown([f.name for f in new.sparse])} here")
    for a, b in zip(old.sparse, new.sparse):
        for key in ("mapping", "type", "list"):
            if getattr(a, key) != getattr(b, key):
                refuse(f"{b.name}'s {key} is {getattr(a, key)} there, {getattr(b, key)} here")
        if b.mapping == "vocab":
            size = vocab_files[b.name]["size"]
            if b.num_embeddings - 1 < size:
                refuse(f"{b.name} holds {size} ids there, more than num_embeddings {b.num_embeddings} leaves room for")
        elif b.mapping != "bucketize" and a.num_embeddings != b.num_embeddings:
            refuse(f"{b.name}'s num_embeddings is {a.num_embeddings} there, {b.num_embeddings} here (its ids would change rows)")


def check_counts(folder: str, manifest: dict) -> list[str]:
    """Every counts file of the dataset at ``folder`` read back against the manifest (its size,
    checksum and fields), for ``data verify``: one line per file that is missing or differs."""
    url = storage.join(folder, MANIFEST)
    sec = vocabulary_section(manifest, url)
    if not sec["counts"]:
        return []
    ds = load_dataset(folder, manifest, check_files=False)
    problems = []
    for f in ds.schema.sparse:
        entry = sec["counts"].get(f.name)
        if entry is None:
            continue
        try:
            ids = read_vocabularies(folder, {f.name: ds.vocab_files[f.name]}, url)[f.name]
            _read_counts(folder, entry, f, ids, sec["version"])
        except storage.StorageNotFoundError:
            missing = storage.join(folder, *entry["path"].split("/"))
            problems.append(f"{missing}: missing (the manifest lists it); preprocess again")
        except (UntrustedInputError, storage.StorageError) as err:
            problems.append(f"{err}; preprocess again")
    return problems


def _read_counts(folder: str, entry: dict, f: Sparse, ids: list, version: int) -> State:
    """A counts file, read no further than its recorded size, checksummed, every field checked."""
    local_member(folder, entry["path"], storage.join(folder, MANIFEST), f"{SECTION}.counts.{f.name}.path")
    url = storage.join(folder, *entry["path"].split("/"))
    data = read_capped(url, MAX_VOCAB_BYTES, entry["bytes"])
    if checksum.digest(data) != entry[checksum.ALGORITHM]:
        raise UntrustedInputError(url, "", f"its bytes differ from when it was written ({checksum.ALGORITHM} checksum "
                                  "mismatch); preprocess that dataset again")  # fmt: skip
    doc = Fields(parse_json(data, url), url)
    if doc.text("feature", 64) != f.name or doc.int("version", hi=MAX_VERSION) != version:
        raise UntrustedInputError(url, "feature", f"must be {f.name}'s counts of version {version}")
    n = len(ids)
    counts = doc.ints("counts", n, hi=MAX_COUNT)
    seen = doc.ints("seen", n, hi=version)
    if len(counts) != n or len(seen) != n:
        raise UntrustedInputError(url, "counts", f"must hold one count and one generation for each of the {n} ids")
    p = doc.obj("pending")
    values = p.list("values", f.num_embeddings)
    pc = p.ints("counts", f.num_embeddings, hi=MAX_COUNT)
    ps = p.ints("seen", f.num_embeddings, hi=version)
    if not len(values) == len(pc) == len(ps):
        raise UntrustedInputError(url, "pending", "values, counts and seen differ in length")
    id_type = int if f.type == "int" else str
    admitted = set(ids)
    for i, v in enumerate(values):
        if type(v) is not id_type or v in admitted:
            raise UntrustedInputError(url, f"pending.values[{i}]", f"must be {'an integer' if id_type is int else 'text'} "
                                      f"id not in the vocabulary, got {shown(v)}")  # fmt: skip
    if len(set(values)) != len(values):
        raise UntrustedInputError(url, "pending.values", "lists an id twice")
    return State(ids, counts, seen, {v: [c, s] for v, c, s in zip(values, pc, ps)})


