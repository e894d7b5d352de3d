"""Vocabularies that grow (issue #42): ``data preprocess --vocab_from PREV`` keeps every id of
PREV's vocabulary on its row, admits new ids by ``min_count`` over counts accumulated across
days, evicts stale (then least counted) ids of a full table and records the rows it reused;
hash features are unchanged; a PREV of another schema, or with damaged counts, is refused in
one line. Each day is a few hand-written rows, so every count is known."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from helpers import cli, one_line_error
from torchrec_cloud.data.vocab import vocabulary_section

SCHEMA = """
name: grow
label: {column: y}
dense: [{name: x}]
sparse:
  - {name: user, type: string, mapping: vocab, num_embeddings: 6, min_count: 2, evict_after: 2}
  - {name: item, type: int, mapping: hash, num_embeddings: 50}
split: {by: part, val_from: 1, test_from: 2}
"""
HASH_ONLY = SCHEMA.replace("mapping: vocab, num_embeddings: 6, min_count: 2, evict_after: 2", "mapping: hash, num_embeddings: 40")


def write_day(path: Path, users: dict[str, int]) -> Path:
    """Training rows with each user ``users`` says how many times, plus a validation and a
    test row (whose users, never counted, are ``held``)."""
    names = [u for u, n in users.items() for _ in range(n)] + ["held", "held"]
    n = len(names)
    table = pa.table({"y": [i % 2 for i in range(n)], "x": [float(i) for i in range(n)], "user": names,
                      "item": [7 * i for i in range(n)], "part": [0] * (n - 2) + [1, 2]})  # fmt: skip
    pq.write_table(table, path)
    return path


def preprocess(capsys, root: Path, day: int, users: dict[str, int], prev: int | None = None, schema: str = "schema.yaml"):
    data = write_day(root / f"day_{day}.parquet", users)
    argv = ["data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(root / schema), "--input", str(data),
            "--output", str(root / f"d{day}")]  # fmt: skip
    if prev is not None:
        argv += ["--vocab_from", str(root / f"d{prev}")]
    rc, out, err = cli(capsys, *argv)
    assert rc == 0, err
    return json.loads((root / f"d{day}" / "manifest.json").read_text())


def rows(root: Path, day: int) -> dict[str, int]:
    """Each user's row on that day (row 0 is every other id)."""
    values = json.loads((root / f"d{day}" / "vocab" / "user.json").read_text())["values"]
    return {u: i + 1 for i, u in enumerate(values)}


def setup(tmp_path: Path) -> Path:
    (tmp_path / "schema.yaml").write_text(SCHEMA)
    (tmp_path / "hash.yaml").write_text(HASH_ONLY)
    return tmp_path


def test_ids_keep_their_rows_across_three_days_and_the_lineage_is_recorded(capsys, tmp_path):
    root = setup(tmp_path)
    m0 = preprocess(capsys, root, 0, {"b": 2, "a": 3, "c": 2})
    m1 = preprocess(capsys, root, 1, {"d": 6, "a": 1, "c": 1}, prev=0)
    m2 = preprocess(capsys, root, 2, {"e": 9, "b": 1}, prev=1)
    assert rows(root, 0) == {"a": 1, "b": 2, "c": 3}  # a fresh vocabulary: most counted first
    assert rows(root, 1) == {"a": 1, "b": 2, "c": 3, "d": 4}  # d, the most counted today, comes after
    assert rows(root, 2) == {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}
    assert [m["transforms"]["table_sizes"][0] for m in (m0, m1, m2)] == [4, 5, 6]
    v0, v1, v2 = (m["vocabulary"] for m in (m0, m1, m2))
    assert (v0["version"], v0["parent"], v0["ancestors"], v0["reset_rows"]) == (0, None, [], {})
    assert (v1["version"], v1["parent"], v1["ancestors"]) == (1, v0["digest"], [v0["digest"]])
    assert (v2["version"], v2["parent"], v2["ancestors"]) == (2, v1["digest"], [v0["digest"], v1["digest"]])
    assert len({v0["digest"], v1["digest"], v2["digest"]}) == 3 and v2["reset_rows"] == {}
    # The one function a warm start reads the section with, on a manifest from before sections
    # too: version 0 and the digest its vocabularies have.
    assert vocabulary_section(m2) == {k: v2[k] for k in v2}
    old = dict(m0)
    del old["vocabulary"]
    assert vocabulary_section(old)["digest"] == v0["digest"] and vocabulary_section(old)["version"] == 0


def test_new_ids_are_admitted_once_their_counts_across_days_reach_min_count(capsys, tmp_path):
    root = setup(tmp_path)
    preprocess(capsys, root, 0, {"a": 2, "z": 1})
    assert "z" not in rows(root, 0)  # once: below min_count 2
    preprocess(capsys, root, 1, {"a": 1, "z": 1, "y": 1}, prev=0)
    assert rows(root, 1) == {"a": 1, "z": 2}  # once yesterday and once today; y only once so far
    preprocess(capsys, root, 2, {"y": 1}, prev=1)
    assert rows(root, 2) == {"a": 1, "z": 2, "y": 3}
    # The same day alone admits neither z nor y: only the counts kept with PREV did.
    preprocess(capsys, root, 3, {"a": 1, "z": 1, "y": 1})
    assert rows(root, 3) == {}


def test_a_full_table_evicts_stale_ids_then_the_least_counted_and_records_the_reused_rows(capsys, tmp_path):
    root = setup(tmp_path)
    preprocess(capsys, root, 0, {"a": 5, "b": 5, "c": 4, "d": 3, "e": 3})  # 5 ids: full (6 rows, row 0 for unknown)
    m1 = preprocess(capsys, root, 1, {"a": 1, "b": 1, "c": 1, "f": 2}, prev=0)
    # d and e are unseen for 1 generation (evict_after: 2), and counted more than f: f waits.
    assert rows(root, 1) == rows(root, 0) and m1["vocabulary"]["reset_rows"] == {}
    m2 = preprocess(capsys, root, 2, {"a": 1, "b": 1, "c": 1, "g": 4, "f": 1}, prev=1)
    # d and e, unseen for 2 generations, are evicted: g (4) and f (2 + 1) take their rows.
    assert rows(root, 2) == {"a": 1, "b": 2, "c": 3, "g": 4, "f": 5}
    assert m2["vocabulary"]["reset_rows"] == {"user": [4, 5]}
    # None stale now: a newcomer counted more than the least counted id (c: 4 + 1 + 1, unseen
    # today; g and f now 7) takes its row; k (2) is counted less than any.
    m3 = preprocess(capsys, root, 3, {"a": 1, "b": 1, "g": 3, "f": 4, "h": 7, "k": 2}, prev=2)
    assert rows(root, 3) == {"a": 1, "b": 2, "h": 3, "g": 4, "f": 5}
    assert m3["vocabulary"]["reset_rows"] == {"user": [3]}
    assert m3["transforms"]["table_sizes"][0] == 6


def test_a_hash_only_schema_is_unchanged_and_its_lineage_recorded(capsys, tmp_path):
    root = setup(tmp_path)
    m0 = preprocess(capsys, root, 0, {"a": 2, "b": 1}, schema="hash.yaml")
    m1 = preprocess(capsys, root, 1, {"a": 1, "c": 3}, prev=0, schema="hash.yaml")
    alone = write_day(root / "alone.parquet", {"a": 1, "c": 3})
    rc, _, err = cli(capsys, "data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(root / "hash.yaml"),
                     "--input", str(alone), "--output", str(root / "alone"))  # fmt: skip
    assert rc == 0, err
    m_alone = json.loads((root / "alone" / "manifest.json").read_text())
    assert m1["transforms"] == m_alone["transforms"] and m1["transforms"]["vocab"] == {}
    assert [s["xxh3_64"] for s in m1["shards"]] == [s["xxh3_64"] for s in m_alone["shards"]]
    v = m1["vocabulary"]
    assert (v["version"], v["parent"], v["reset_rows"]) == (1, m0["vocabulary"]["digest"], {})
    assert v["digest"] == m0["vocabulary"]["digest"]  # the same ids on the same rows


def test_prev_of_another_schema_is_refused_in_one_line(capsys, tmp_path):
    root = setup(tmp_path)
    preprocess(capsys, root, 0, {"a": 2}, schema="hash.yaml")
    data = write_day(root / "day_1.parquet", {"a": 2})
    line = one_line_error(capsys, 1, "data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"),
                          "--input", str(data), "--vocab_from", str(root / "d0"), "--output", str(root / "d1"))  # fmt: skip
    assert "--vocab_from" in line and "user's mapping is hash there, vocab here" in line
    assert not (root / "d1" / "manifest.json").exists()


def test_damaged_counts_are_refused_in_one_line(capsys, tmp_path):
    root = setup(tmp_path)
    preprocess(capsys, root, 0, {"a": 2, "b": 2})
    assert cli(capsys, "data", "verify", str(root / "d0"))[0] == 0
    counts = root / "d0" / "vocab" / "user.counts.json"
    counts.write_text(counts.read_text().replace('"counts": [2, 2]', '"counts": [9, 2]'))
    data = write_day(root / "day_1.parquet", {"a": 2})
    argv = ["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input", str(data),
            "--vocab_from", str(root / "d0"), "--output", str(root / "d1")]  # fmt: skip
    line = one_line_error(capsys, 1, *argv)
    assert "user.counts.json" in line and "checksum" in line
    rc, _, err = cli(capsys, "data", "verify", str(root / "d0"))
    assert rc == 1 and "user.counts.json" in err and "Traceback" not in err
    counts.write_text(counts.read_text() + " ")  # longer than recorded
    assert "user.counts.json" in one_line_error(capsys, 1, *argv)
    manifest = root / "d0" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["vocabulary"]["digest"] = "0" * 64  # a lineage claimed that its vocabularies do not have
    manifest.write_text(json.dumps(m))
    line = one_line_error(capsys, 1, *argv)
    assert "manifest.json: vocabulary.digest: is not the digest of this dataset's vocabularies" in line
    assert not (root / "d1" / "manifest.json").exists()


def test_a_drifting_world_grows_the_vocabularies_and_every_kept_id_keeps_its_row(capsys, tmp_path):
    """events_gen's drift (new items, churning users) over three days, both ids by vocabulary:
    each day admits new ids, and an id of yesterday's vocabulary is on the same row today."""
    from torchrec_cloud.data.events_gen import SCHEMA as EVENTS, Drift, generate, write_events

    drift = Drift(new_items=30, popularity_shift=0.1, user_churn=0.3)
    assert set(generate(300, 0, 1)["user"]) == set(generate(300, 0, 1, Drift())["user"])  # no drift: the same rows
    info = write_events(str(tmp_path / "events"), days=3, rows_per_day=1500, seed=1, drift=drift)
    assert all(0.5 < auc < 1 for auc in info["bayes_auc_by_day"])
    both = EVENTS.replace("mapping: hash, num_embeddings: 600", "mapping: vocab, num_embeddings: 600")
    (tmp_path / "schema.yaml").write_text(both)
    vocabularies = []
    for day, path in enumerate(info["files"]):
        argv = ["data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(tmp_path / "schema.yaml"),
                "--input", path, "--output", str(tmp_path / f"d{day}")]  # fmt: skip
        rc, _, err = cli(capsys, *argv + (["--vocab_from", str(tmp_path / f"d{day - 1}")] if day else []))
        assert rc == 0, err
        vocabularies.append({n: json.loads((tmp_path / f"d{day}" / "vocab" / f"{n}.json").read_text())["values"]
                             for n in ("user", "item")})  # fmt: skip
    for before, after in zip(vocabularies, vocabularies[1:]):
        for name in ("user", "item"):
            assert after[name][: len(before[name])] == before[name]  # room to spare: nothing evicted
            assert len(after[name]) > len(before[name])
    assert any(i >= 300 for i in vocabularies[2]["item"]) and any("-" in u for u in vocabularies[2]["user"])
