"""Criteo preprocessing and reading, as a user meets them: the ``data preprocess`` command
on files in the exact Criteo formats, checked against TorchRec's own preprocessing; bad
input; resuming; reading from storage emulators; and rows reaching ranks exactly once."""

from __future__ import annotations

import gzip
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from torchrec_cloud import storage
from torchrec_cloud.cli import main
from torchrec_cloud.config import ConfigError, parse_job_config
from torchrec_cloud.progress import plural
from torchrec_cloud.data.criteo_format import record_dtype
from torchrec_cloud.data.criteo_gen import format_lines, generate, write_criteo_tsv
from torchrec_cloud.data.reader import build_criteo_source, criteo_source
from torchrec_cloud.data.multihot import expand_multi_hot

SIZES = [97, 1000, 5, 20000, 333] + [1000] * 21


def preprocess(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["data", "preprocess", "--no_progress", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def torchrec_npys(tsv: Path, tmp: Path):
    """TorchRec's own TSV -> npy conversion of ``tsv`` (dense, sparse, labels)."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    names = [str(tmp / f"ref_{tsv.stem}_{k}.npy") for k in ("dense", "sparse", "labels")]
    # Kaggle and 1TB lines are parsed alike; "criteo_kaggle" would treat any path
    # containing "test" (pytest's tmp folders do) as the unlabelled Kaggle test set.
    BinaryCriteoUtils.tsv_to_npys(str(tsv), *names, dataset_name="criteo_1tb")
    return [np.load(n) for n in names]


def shard_records(out: str) -> np.ndarray:
    manifest = json.loads(storage.read_bytes(storage.join(out, "manifest.json")))
    dtype = record_dtype(manifest["record"]["fields"][2]["dtype"])
    parts = [np.frombuffer(storage.read_bytes(storage.join(out, s["path"])), dtype) for s in manifest["shards"]]
    return np.concatenate(parts)


def read_all(src) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What training and evaluation read from ``src``, every row of train, val and test in
    order: labels, dense features (after the transform), the 26 ids."""
    labels, dense, ids = [], [], []
    for split in ("train", "val", "test"):
        for batch, valid in src.eval_batches(split):
            labels.append(batch.labels[:valid].numpy())
            dense.append(batch.dense_features[:valid].numpy())
            kjt = batch.sparse_features
            ids.append(np.stack([kjt[f"cat_{i}"].values().numpy()[:valid] for i in range(26)], axis=1))
    return np.concatenate(labels), np.concatenate(dense), np.concatenate(ids)


def test_kaggle_matches_torchrec_preprocessing(tmp_path, capsys):
    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=3000, seed=0)
    out = tmp_path / "kaggle"
    rc, stdout, err = preprocess(
        capsys, "--format", "kaggle", "--input", str(tsv), "--output", str(out),
        "--num_embeddings_per_feature", ",".join(map(str, SIZES)),
        "--workers", "2", "--chunk_mb", "0.1",
    )
    assert rc == 0, err
    assert "wrote 3000 rows" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2  # several chunks, converted by two processes
    # One dataset format: Criteo is the built-in schema.
    assert manifest["format"] == "torchrec-cloud-shards" and manifest["schema"]["name"] == "criteo"

    # What training reads is TorchRec's preprocessing of the same lines, row by row: the
    # labels, the dense features after the transform (bit for bit), the ids (modulo the tables).
    dense, sparse, labels = torchrec_npys(tsv, tmp_path)
    src = criteo_source(str(out), batch_size=100, rank=0, world_size=1, table_sizes=SIZES)
    got_labels, got_dense, got_ids = read_all(src)
    np.testing.assert_array_equal(got_labels, labels[:, 0])
    np.testing.assert_array_equal(got_dense, dense)
    np.testing.assert_array_equal(got_ids, sparse % np.array(SIZES))

    # The splits are the references': the last 1/7 held out, split in half.
    held = 3000 // 7
    assert manifest["rows"] == 3000
    split_rows = {k: sum(e - s for _, s, e in v) for k, v in manifest["splits"].items()}
    assert split_rows == {"train": 3000 - held, "val": (held + 1) // 2, "test": held // 2}
    batches = list(src.train_batches(0))
    assert len(batches) == (3000 - held) // 100
    got = torch.cat([b.dense_features for b in batches]).numpy()
    np.testing.assert_array_equal(got, dense[: len(got)])
    val = [b for b, valid in src.eval_batches("val")]
    start = 3000 - held
    np.testing.assert_array_equal(val[0].dense_features.numpy(), dense[start : start + 100])


def test_terabyte_gzip_days_match_torchrec(tmp_path, capsys):
    days = []
    for d, rows in enumerate([700, 500, 301]):
        cols = generate(rows, seed=d)
        text = "\n".join(format_lines(cols)) + "\n"
        plain = tmp_path / f"plain_day_{d}"
        plain.write_text(text)
        path = tmp_path / (f"day_{d}.gz" if d < 2 else f"day_{d}")
        if d < 2:
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            path.write_text(text)
        days.append((path, plain))
    out = tmp_path / "tb"
    rc, stdout, err = preprocess(
        capsys, "--format", "terabyte", "--input", *[str(p) for p, _ in days],
        "--output", str(out), "--num_embeddings", "5000", "--rows_per_shard", "200",
    )
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "torchrec-cloud-shards" and manifest["schema"]["name"] == "criteo"
    ref = [torchrec_npys(plain, tmp_path) for _, plain in days]
    assert [s["rows"] for s in manifest["sources"]] == [700, 500, 301]
    # Days 0..N-2 train; the last day's first half (rounded up) val, second half test.
    split_rows = {k: sum(e - s for _, s, e in v) for k, v in manifest["splits"].items()}
    assert split_rows == {"train": 1200, "val": 151, "test": 150}
    # Row by row as TorchRec's preprocessing of each day file (its dense shift is the day's own).
    src = criteo_source(str(out), batch_size=150, rank=0, world_size=1, table_sizes=[5000] * 26)
    got_labels, got_dense, got_ids = read_all(src)
    np.testing.assert_array_equal(got_labels, np.concatenate([r[2][:, 0] for r in ref]))
    np.testing.assert_array_equal(got_dense, np.concatenate([r[0] for r in ref]))
    np.testing.assert_array_equal(got_ids, np.concatenate([r[1] for r in ref]) % 5000)
    test_batches = list(src.eval_batches("test"))
    assert [v for _, v in test_batches] == [150]
    np.testing.assert_array_equal(test_batches[0][0].dense_features.numpy(), ref[2][0][151:])


def test_a_criteo_dataset_of_an_older_version_is_refused_naming_the_command(tmp_path, capsys):
    from helpers import one_line_error

    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=300, seed=1)
    out = tmp_path / "old"
    assert preprocess(capsys, "--format", "kaggle", "--input", str(tsv), "--output", str(out), "--num_embeddings", "50")[0] == 0
    # The manifest as versions before Criteo was the built-in schema wrote it.
    m = json.loads((out / "manifest.json").read_text())
    old = {"format": "torchrec-cloud-criteo-shards", "version": 1, "dataset": "kaggle", "rows": m["rows"],
           "record": m["record"], "num_embeddings_per_feature": [50] * 26, "sources": m["sources"],
           "shards": m["shards"], "splits": m["splits"]}
    (out / "manifest.json").write_text(json.dumps(old))
    rewrite = f"torchrec-cloud data preprocess --format kaggle --input {tsv} --output NEW_FOLDER --num_embeddings_per_feature 50,"
    for argv in (["train", "--dataset_path", str(out), "--num_batches_per_epoch", "1"],
                 ["data", "verify", str(out)]):
        line = one_line_error(capsys, 2 if argv[0] == "train" else 1, *argv)
        assert "older version" in line and rewrite in line, line
    with pytest.raises(ConfigError, match="older version"):
        criteo_source(str(out), batch_size=10, rank=0, world_size=1, table_sizes=[50] * 26)


def test_resume_converts_only_missing_shards(tmp_path, capsys):
    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=2000, seed=1)
    out = tmp_path / "out"
    args = ["--format", "kaggle", "--input", str(tsv), "--output", str(out), "--num_embeddings", "1000",
            "--chunk_mb", "0.05", "--workers", "1"]
    assert preprocess(capsys, *args)[0] == 0
    shards = sorted((out / "shards").glob("*.bin"))
    # An interrupted run: the manifest and the last shards never got written.
    (out / "manifest.json").unlink()
    for s in shards[-2:]:
        s.unlink()
        Path(str(s) + ".done").unlink()
    shards[0].write_bytes(b"garbage that must be kept as it is committed")  # proves no rewrite
    rc, stdout, _ = preprocess(capsys, *args)
    assert rc == 0
    assert f"resumed: {plural(len(shards) - 2, 'shard')} " in stdout
    assert shards[0].read_bytes().startswith(b"garbage")
    assert len(shards) == len(sorted((out / "shards").glob("*.bin")))
    # Same settings, different table size: refused instead of mixing two runs.
    rc, _, err = preprocess(capsys, *[a if a != "1000" else "999" for a in args])
    assert rc == 1 and "different settings" in err and "num_embeddings_per_feature" in err


def test_resume_output_equals_uninterrupted(tmp_path, capsys):
    tsv = tmp_path / "day_0.gz"
    write_criteo_tsv(str(tsv), rows=1500, seed=2)
    plain = tmp_path / "day_1"
    write_criteo_tsv(str(plain), rows=500, seed=3)
    out = tmp_path / "out"
    args = ["--format", "terabyte", "--input", str(tsv), str(plain), "--output", str(out),
            "--rows_per_shard", "400", "--chunk_mb", "0.02", "--num_embeddings", "777"]
    assert preprocess(capsys, *args)[0] == 0
    whole = shard_records(str(out))
    (out / "manifest.json").unlink()
    for name in ("day_0-00001.bin", "day_0-00003.bin", "day_1-00000.bin"):
        (out / "shards" / name).unlink()
        (out / "shards" / (name + ".done")).unlink()
    rc, stdout, _ = preprocess(capsys, *args)
    assert rc == 0 and "resumed:" in stdout
    np.testing.assert_array_equal(shard_records(str(out)), whole)


def test_shares_write_what_one_run_writes(tmp_path, capsys):
    """Criteo's TSV in shares (the pods of an Indexed Job), as a schema's inputs are: share I
    takes tasks I, I + N, ... (byte ranges, gzip files), the share that finds every task
    committed writes the manifest, and the dataset is the one a single run writes."""
    day0 = tmp_path / "day_0.gz"
    write_criteo_tsv(str(day0), rows=900, seed=6)
    day1 = tmp_path / "day_1"
    write_criteo_tsv(str(day1), rows=700, seed=7)
    args = ["--format", "terabyte", "--input", str(day0), str(day1), "--rows_per_shard", "400", "--chunk_mb", "0.03",
            "--num_embeddings", "777", "--workers", "1"]  # fmt: skip
    assert preprocess(capsys, *args, "--output", str(tmp_path / "one"))[0] == 0
    out = tmp_path / "shared"
    rc, stdout, err = preprocess(capsys, *args, "--output", str(out), "--shares", "2", "--share_index", "1")
    assert rc == 0, err
    assert "share 1 of 2: converted" in stdout and not (out / "manifest.json").exists()
    # A shard of share 1's lost since (its task's record stays): no manifest without it.
    lost = sorted((out / "shards").glob("day_1-*.bin.done"))[-1]
    lost.unlink()
    rc, stdout, err = preprocess(capsys, *args, "--output", str(out), "--shares", "2", "--share_index", "0")
    assert rc == 0 and "share 0 of 2: converted" in stdout and not (out / "manifest.json").exists(), (stdout, err)
    # Share 1 again (a retried pod) converts it and, finding every task, writes the manifest.
    rc, stdout, err = preprocess(capsys, *args, "--output", str(out), "--shares", "2", "--share_index", "1")
    assert rc == 0 and "wrote 1600 rows" in stdout, (stdout, err)
    one, shared = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "shared"))
    assert shared["splits"] == one["splits"] and shared["sources"] == one["sources"]
    np.testing.assert_array_equal(shard_records(str(out)), shard_records(str(tmp_path / "one")))


BAD_LINES = {
    "fields": ("1\t2\t3", "expected 40 tab-separated fields"),
    "dense": (None, "integer feature int_4"),
    "hex": (None, "categorical feature cat_7"),
    "label": (None, "label must be 0 or 1"),
}


def _bad_file(path: Path, kind: str, bad_at: list[int], rows: int = 1200) -> None:
    lines = format_lines(generate(rows, seed=5))
    for i in bad_at:
        fields = lines[i].split("\t")
        if kind == "fields":
            lines[i] = "1\t2\t3"
        elif kind == "dense":
            fields[5] = "12.5"
            lines[i] = "\t".join(fields)
        elif kind == "hex":
            fields[1 + 13 + 7] = "zz12"
            lines[i] = "\t".join(fields)
        else:
            fields[0] = "2"
            lines[i] = "\t".join(fields)
    text = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(tmp_path, capsys, kind):
    path = tmp_path / "train.txt"
    _bad_file(path, kind, [987])  # in a later chunk: line numbers count earlier chunks
    rc, _, err = preprocess(capsys, "--format", "kaggle", "--input", str(path), "--output",
                            str(tmp_path / "o"), "--chunk_mb", "0.03", "--workers", "2")
    assert rc == 1
    assert f"{path}:988: {BAD_LINES[kind][1]}" in err
    assert "--on_bad_line skip" in err


def test_bad_line_in_gzip_day_names_line(tmp_path, capsys):
    day = tmp_path / "day_1.gz"
    _bad_file(day, "hex", [450])
    other = tmp_path / "day_0"
    write_criteo_tsv(str(other), rows=300)
    rc, _, err = preprocess(capsys, "--format", "terabyte", "--input", str(other), str(day),
                            "--output", str(tmp_path / "o"), "--rows_per_shard", "200")
    assert rc == 1
    assert f"{day}:451: categorical feature cat_7" in err


def test_skip_mode_counts_and_reports(tmp_path, capsys):
    path = tmp_path / "train.txt"
    bad = [3, 400, 401, 1100]
    _bad_file(path, "dense", bad, rows=1200)
    out = tmp_path / "o"
    args = ["--format", "kaggle", "--input", str(path), "--output", str(out), "--chunk_mb", "0.03",
            "--workers", "1"]
    rc, _, err = preprocess(capsys, *args)
    assert rc == 1 and f"{path}:4: integer feature int_4" in err
    # Rerunning as the message suggests finishes the same output.
    rc, stdout, err = preprocess(capsys, *args, "--on_bad_line", "skip")
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_lines"] == 4
    assert manifest["rows"] == 1196
    assert "skipped 4 bad lines" in stdout
    assert f"{path}:4: integer feature int_4" in stdout
    assert f"{path}:1101:" in "\n".join(manifest["skipped_examples"])
    good = [i for i in range(1200) if i not in bad]
    cols = generate(1200, seed=5)
    np.testing.assert_array_equal(shard_records(str(out))["label"], cols["labels"][good])


def test_empty_and_truncated_files(tmp_path, capsys):
    empty = tmp_path / "train.txt"
    empty.write_bytes(b"")
    rc, _, err = preprocess(capsys, "--format", "kaggle", "--input", str(empty), "--output", str(tmp_path / "a"))
    assert rc == 1 and f"{empty}: the file is empty" in err

    day0 = tmp_path / "day_0"
    write_criteo_tsv(str(day0), rows=100)
    full = tmp_path / "full.gz"
    write_criteo_tsv(str(full), rows=3000)
    cut = tmp_path / "day_1.gz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    rc, _, err = preprocess(capsys, "--format", "terabyte", "--input", str(day0), str(cut),
                            "--output", str(tmp_path / "b"))
    assert rc == 1 and f"{cut}: truncated gzip file" in err

    empty_gz = tmp_path / "day_2.gz"
    with gzip.open(empty_gz, "wb"):
        pass
    rc, _, err = preprocess(capsys, "--format", "terabyte", "--input", str(day0), str(empty_gz),
                            "--output", str(tmp_path / "c"))
    assert rc == 1 and f"{empty_gz}: the file is empty" in err

    rc, _, err = preprocess(capsys, "--format", "kaggle", "--input", str(tmp_path / "nope.txt"),
                            "--output", str(tmp_path / "d"))
    assert rc == 1 and "nope.txt" in err and "not found" in err


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("fmt", ["kaggle", "terabyte"])
def test_crlf_files_preprocess_to_the_same_bytes_as_lf(tmp_path, capsys, monkeypatch, umask_022, fmt):
    """Windows line endings: every output file equals that of the same lines with LF, byte for
    byte, but for what records the input files themselves (their sizes, in _plan.json) and the
    manifest's creation time. Every output is readable by others (0644 under umask 0022)."""
    names = ["train.txt"] if fmt == "kaggle" else ["day_0.gz", "day_1.gz"]
    outputs = {}
    for ending in ("lf", "crlf"):
        folder = tmp_path / ending
        folder.mkdir()
        monkeypatch.chdir(folder)  # the same input names in both runs' records
        for seed, name in enumerate(names):
            text = "".join(line + ("\r\n" if ending == "crlf" else "\n") for line in format_lines(generate(900, seed)))
            data = text.encode()
            Path(name).write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
        rc, _, err = preprocess(capsys, "--format", fmt, "--input", *names, "--output", "out",
                                "--rows_per_shard", "400", "--num_embeddings", "1000")  # fmt: skip
        assert rc == 0, err
        outputs[ending] = {p.relative_to(folder / "out"): p for p in sorted((folder / "out").rglob("*")) if p.is_file()}
    lf, crlf = outputs["lf"], outputs["crlf"]
    assert sorted(lf) == sorted(crlf) and len([n for n in lf if n.suffix == ".bin"]) == (1 if fmt == "kaggle" else 6)
    for name in lf:
        assert stat.S_IMODE(crlf[name].stat().st_mode) == 0o644, name
        if name.name in ("_plan.json", "manifest.json"):
            a, b = json.loads(lf[name].read_text()), json.loads(crlf[name].read_text())
            for record in (a, b):
                record.pop("input_sizes", None)
                record.pop("created_unix", None)
            assert a == b, name
        else:
            assert lf[name].read_bytes() == crlf[name].read_bytes(), name
    assert json.loads(lf[Path("manifest.json")].read_text())["rows"] == 900 * len(names)


TRAIN_ROWS = 4880  # = 2 ranks x 40 batches x 61 rows
EVAL_ROWS = 1431  # val 716, test 715: uneven over 2 and 3 ranks
BIG = [2**40] * 26  # no modulo: ids stay row numbers


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """A 1TB-style dataset whose cat_0 id is the row number (stored raw, int64)."""
    tmp = tmp_path_factory.mktemp("numbered")
    lines = []
    for i, line in enumerate(format_lines(generate(TRAIN_ROWS + EVAL_ROWS, seed=9))):
        fields = line.split("\t")
        fields[14] = f"{i:x}"
        lines.append("\t".join(fields))
    day0, day1 = tmp / "day_0", tmp / "day_1"
    day0.write_text("\n".join(lines[:TRAIN_ROWS]) + "\n")
    day1.write_text("\n".join(lines[TRAIN_ROWS:]) + "\n")
    out = tmp / "out"
    assert main(["data", "preprocess", "--no_progress", "--format", "terabyte", "--input", str(day0),
                 str(day1), "--output", str(out), "--chunk_mb", "0.2"]) == 0
    return str(out)


def _row_ids(batch) -> np.ndarray:
    return batch.sparse_features["cat_0"].values().numpy()


def _epoch_rows(sources, epoch: int) -> np.ndarray:
    return np.concatenate([_row_ids(b) for src in sources for b in src.train_batches(epoch)])


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_read_every_train_row_exactly_once(numbered, shuffle):
    ranks = [criteo_source(numbered, batch_size=61, rank=r, world_size=2, table_sizes=BIG,
                          shuffle=shuffle, seed=4, window_rows=244) for r in (0, 1)]
    assert [s.num_train_batches() for s in ranks] == [40, 40]
    orders = []
    for epoch in (0, 1):
        seen = _epoch_rows(ranks, epoch)
        assert sorted(seen.tolist()) == list(range(TRAIN_ROWS))
        orders.append(seen)
    assert np.array_equal(orders[0], orders[1]) != shuffle  # shuffle: a new order per epoch


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_leave_out_only_the_remainder(numbered, shuffle):
    # 4880 rows, 2 ranks x 64: 38 batches each, 4864 rows used, 16 left out per epoch.
    ranks = [criteo_source(numbered, batch_size=64, rank=r, world_size=2, table_sizes=BIG,
                          shuffle=shuffle, seed=4, window_rows=320) for r in (0, 1)]
    assert [s.num_train_batches() for s in ranks] == [38, 38]
    used = set()
    for epoch in range(3):
        seen = _epoch_rows(ranks, epoch)
        assert len(seen) == len(set(seen.tolist())) == 4864  # no row twice
        assert seen.max() < TRAIN_ROWS  # only training rows
        if not shuffle:
            assert sorted(seen.tolist()) == list(range(4864))  # the split's last rows wait
        used |= set(seen.tolist())
    if shuffle:
        assert len(used) > 4864  # other rows are left out in other epochs


def test_resume_mid_epoch_gives_the_same_batches(numbered):
    src = criteo_source(numbered, batch_size=50, rank=1, world_size=2, table_sizes=BIG,
                       shuffle=True, seed=7, window_rows=300)
    full = [_row_ids(b) for b in src.train_batches(2)]
    resumed = [_row_ids(b) for b in src.train_batches(2, start_batch=13)]
    assert len(resumed) == len(full) - 13
    for a, b in zip(full[13:], resumed):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_covers_every_row_exactly_once(numbered, world_size):
    for split, lo, hi in (("val", TRAIN_ROWS, TRAIN_ROWS + 716), ("test", TRAIN_ROWS + 716, TRAIN_ROWS + EVAL_ROWS)):
        srcs = [criteo_source(numbered, batch_size=100, rank=r, world_size=world_size,
                             table_sizes=BIG, window_rows=200) for r in range(world_size)]
        outputs = [list(s.eval_batches(split)) for s in srcs]
        assert len({len(o) for o in outputs}) == 1  # same number of items on every rank
        seen = []
        for o in outputs:
            for batch, valid in o:
                assert batch.labels.numel() == 100
                seen.extend(_row_ids(batch)[:valid].tolist())
        assert sorted(seen) == list(range(lo, hi))


def test_an_eval_sample_is_fixed_spread_and_the_same_on_any_number_of_ranks(numbered, monkeypatch):
    from torchrec_cloud.data import shards

    monkeypatch.setattr(shards, "SAMPLE_BLOCK_ROWS", 50)  # 300 rows: 6 blocks of 50 (every layout's reader)
    picked = {}
    for world_size in (1, 2, 3):
        srcs = [criteo_source(numbered, batch_size=100, rank=r, world_size=world_size, table_sizes=BIG,
                             window_rows=200) for r in range(world_size)]  # fmt: skip
        assert {s.num_eval_rows("val") for s in srcs} == {716}
        outputs = [list(s.eval_batches("val", 300)) for s in srcs]
        assert len({len(o) for o in outputs}) == 1  # same number of items on every rank
        picked[world_size] = sorted(x for o in outputs for b, n in o for x in _row_ids(b)[:n].tolist())
    assert len(picked[1]) == 300 and picked[1] == picked[2] == picked[3]
    # Spread over the split, not its first rows (a day's log read in order is in time order).
    starts = [TRAIN_ROWS + 716 * k // 6 for k in range(6)]  # the split's sixths
    assert picked[1] == [x for s in starts for x in range(s, s + 50)]
    src = criteo_source(numbered, batch_size=100, rank=0, world_size=1, table_sizes=BIG)
    whole = [x for b, n in src.eval_batches("val", 5000) for x in _row_ids(b)[:n].tolist()]
    assert whole == list(range(TRAIN_ROWS, TRAIN_ROWS + 716))


@pytest.mark.parametrize("multi_hot", [None, [2] * 13 + [1] * 13], ids=["one-hot", "multi-hot"])
def test_batches_carry_their_feature_counts(numbered, multi_hot):
    # Counted on the host: TorchRec's input dist would otherwise sum them on the GPU and copy
    # them back, a blocking copy per batch (data.keyed_jagged_tensor).
    src = criteo_source(numbered, batch_size=64, rank=0, world_size=1, table_sizes=BIG, multi_hot_sizes=multi_hot)
    for batch in (next(src.train_batches(0)), next(src.eval_batches("val"))[0]):
        kjt = batch.sparse_features
        counts = kjt.lengths().view(26, 64).sum(1).tolist()
        assert kjt.length_per_key_or_none() == counts
        assert kjt.offset_per_key_or_none() == np.concatenate([[0], np.cumsum(counts)]).tolist()


def test_reader_errors_name_the_problem(tmp_path, numbered):
    with pytest.raises(ConfigError, match="manifest.json not found.*data preprocess"):
        criteo_source(str(tmp_path), batch_size=10, rank=0, world_size=1, table_sizes=[10] * 26)
    with pytest.raises(ConfigError, match="--batch_size: .*4880 training rows"):
        criteo_source(numbered, batch_size=3000, rank=0, world_size=2, table_sizes=BIG)
    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=800)
    assert main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(tsv),
                 "--output", str(tmp_path / "o"), "--num_embeddings", "5000"]) == 0
    cfg = parse_job_config(["--dataset_path", str(tmp_path / "o"), "--num_embeddings", "4000"])
    with pytest.raises(ConfigError, match="--num_embeddings_per_feature: .*ids up to 4999"):
        build_criteo_source(cfg, 0, 1)


def test_criteo_and_a_schemas_datasets_are_read_by_the_one_reader(numbered):
    """train --dataset_path reads a Criteo dataset with the reader of every dataset: the same
    class, its records made into batches by Criteo's batcher."""
    from torchrec_cloud.data.reader import SchemaSource, build_dataset_source

    cfg = parse_job_config(["--dataset_path", numbered, "--batch_size", "64"])
    cfg.model.num_embeddings_per_feature = BIG
    src = build_dataset_source(cfg, 0, 1)
    assert type(src) is SchemaSource and src.criteo is not None
    batch = next(src.train_batches(0))
    assert _row_ids(batch).tolist() == list(range(64))  # cat_0 holds the row number, in file order


def test_multi_hot_bags():
    ids = torch.tensor([[5, 7, 1], [5, 8, 2], [9, 7, 3]])
    kjt = expand_multi_hot(ids, [3, 1, 4], [10, 20, 1000])
    assert kjt.keys() == ["cat_0", "cat_1", "cat_2"]
    assert kjt.lengths().tolist() == [3, 3, 3, 1, 1, 1, 4, 4, 4]
    bags = kjt["cat_0"].values().view(3, 3)
    assert bags[:, 0].tolist() == [5, 5, 9]  # the id leads its bag
    assert torch.equal(bags[0], bags[1])  # same id, same bag
    assert int(kjt.values().max()) < 1000 and int(kjt["cat_0"].values().max()) < 10
    g = torch.Generator().manual_seed(0)
    rnd = expand_multi_hot(ids.repeat(50, 1), [3, 1, 4], [10, 20, 1000], g, pooling="random")
    lengths = rnd["cat_2"].lengths()
    assert lengths.min() >= 1 and lengths.max() <= 4 and len(set(lengths.tolist())) == 4
    assert rnd.values().numel() == int(rnd.lengths().sum())


def test_multi_hot_from_criteo_shards(numbered):
    sizes = [2] * 13 + [1] * 13
    src = criteo_source(numbered, batch_size=64, rank=0, world_size=1, table_sizes=BIG,
                       multi_hot_sizes=sizes)
    batch = next(src.train_batches(0))
    assert batch.sparse_features["cat_0"].lengths().tolist() == [2] * 64
    assert batch.sparse_features["cat_20"].lengths().tolist() == [1] * 64
    assert batch.sparse_features["cat_0"].values()[::2].tolist() == list(range(64))


def test_multi_hot_sizes_flag_is_checked():
    cfg = parse_job_config(["--multi_hot_sizes", "3,2"])
    from torchrec_cloud.data import build_data_source

    with pytest.raises(ConfigError, match="--multi_hot_sizes: needs one bag size per sparse feature"):
        build_data_source(cfg, 0, 1)
    with pytest.raises(ConfigError, match="--multi_hot_sizes"):
        parse_job_config(["--multi_hot_sizes", "3,0"])


def test_preprocess_to_bucket_and_read_back(storage_root, tmp_path, capsys):
    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=1400, seed=11)
    local = tmp_path / "local"
    args = ["--format", "kaggle", "--input", str(tsv), "--num_embeddings", "3000", "--chunk_mb", "0.1",
            "--workers", "1"]
    assert preprocess(capsys, *args, "--output", str(local))[0] == 0
    # Input from the bucket too: byte ranges of a plain file, and a gzip stream.
    remote_tsv = storage.join(storage_root, "raw", "train.txt")
    storage.write_bytes(remote_tsv, tsv.read_bytes())
    rc, stdout, err = preprocess(capsys, *[remote_tsv if a == str(tsv) else a for a in args],
                                 "--output", storage_root)
    assert rc == 0, err
    assert f"to {storage_root}" in stdout
    kw = dict(batch_size=128, rank=0, world_size=1, table_sizes=[3000] * 26, shuffle=True, seed=2)
    a = list(criteo_source(str(local), **kw).train_batches(0))
    b = list(criteo_source(storage_root, **kw).train_batches(0))
    assert len(a) == len(b) == (1400 - 1400 // 7) // 128
    for x, y in zip(a, b):
        assert torch.equal(x.dense_features, y.dense_features)
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
        assert torch.equal(x.labels, y.labels)
    gz = storage.join(storage_root, "raw", "day_1.gz")
    storage.write_bytes(gz, gzip.compress(tsv.read_bytes()))
    rc, _, err = preprocess(capsys, "--format", "terabyte", "--input", remote_tsv, gz,
                            "--output", storage.join(storage_root, "tb"), "--rows_per_shard", "500")
    assert rc == 0, err
    tb = json.loads(storage.read_bytes(storage.join(storage_root, "tb", "manifest.json")))
    assert [s["rows"] for s in tb["sources"]] == [1400, 1400]


def test_parser_reads_fields_as_python_int_does():
    """Every field the fast parser accepts has the value Python's int() gives it, and it
    rejects exactly the fields int() (decimal) or int(x, 16) (hex) would not take as plain
    digits; long fields (beyond 8 characters) take the general path."""
    from torchrec_cloud.data.criteo_parse import _parse_numbers, _parse_swar

    rng = np.random.default_rng(0)
    alphabet = list("0123456789abcdefABCDEF-x .g")
    fields = ["".join(rng.choice(alphabet, size=rng.integers(0, 9))) for _ in range(3000)]
    fields += [format(int(v), "x") for v in rng.integers(0, 2**32, 500)] + ["", "0", "-7", "-"]
    fields += [str(int(v)) for v in rng.integers(-999, 99_999_999, 500)]
    buf = np.frombuffer(("\t".join(fields) + "\n").encode(), np.uint8)
    ends = np.flatnonzero((buf == 9) | (buf == 10))
    starts = np.concatenate(([0], ends[:-1] + 1))
    padded = np.concatenate((np.zeros(8, np.uint8), buf))
    for base, digits in ((10, "0123456789"), (16, "0123456789abcdefABCDEF")):
        fast = _parse_swar(padded, starts, ends, base)
        general = _parse_numbers(buf, starts, ends, base, 15)
        for (values, ok) in (fast, general):
            for i, f in enumerate(fields):
                body = f[1:] if base == 10 and f.startswith("-") else f
                accepted = all(c in digits for c in body) and f != "-"
                assert bool(ok[i]) == accepted, (base, f)
                if accepted:
                    assert values[i] == (int(f, base) if f else 0), (base, f)
    long = ["123456789012", "ffffffffffff", "-2147483648"]
    buf = np.frombuffer(("\t".join(long) + "\n").encode(), np.uint8)
    ends = np.flatnonzero((buf == 9) | (buf == 10))
    starts = np.concatenate(([0], ends[:-1] + 1))
    padded = np.concatenate((np.zeros(8, np.uint8), buf))
    assert _parse_swar(padded, starts, ends, 10) is None
    values, ok = _parse_numbers(buf, starts, ends, 16, 15)
    assert values[1] == 0xFFFFFFFFFFFF and ok[1]


def test_killed_run_resumes_to_the_same_output(tmp_path, capsys):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path as P

    day0 = tmp_path / "day_0.gz"
    write_criteo_tsv(str(day0), rows=30_000, seed=4)
    day1 = tmp_path / "day_1"
    write_criteo_tsv(str(day1), rows=300, seed=5)
    # 300 small shards: the run is still busy when the third one is committed.
    args = ["--format", "terabyte", "--input", str(day0), str(day1), "--rows_per_shard", "100",
            "--num_embeddings", "1000", "--workers", "1"]
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(P(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "torchrec_cloud", "data", "preprocess", "--no_progress",
                             *args, "--output", str(out)], env=env)
    def committed() -> int:
        # A marker being written is a hidden '.tmp-...-<name>.done' until it is renamed;
        # the resumed run deletes those, so they must not count.
        return sum(1 for p in (out / "shards").glob("*.done") if not p.name.startswith("."))

    deadline = time.monotonic() + 300
    while committed() < 3 and time.monotonic() < deadline:
        assert proc.poll() is None, "preprocessing ended before it could be interrupted"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    done = committed()
    rc, stdout, err = preprocess(capsys, *args, "--output", str(out))
    assert rc == 0, err
    assert f"resumed: {plural(done, 'shard')} " in stdout
    assert preprocess(capsys, *args, "--output", str(tmp_path / "clean"))[0] == 0
    np.testing.assert_array_equal(shard_records(str(out)), shard_records(str(tmp_path / "clean")))
