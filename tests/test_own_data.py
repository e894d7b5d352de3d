"""Your own data, as a user brings it: Parquet and CSV event logs with string ids, list features,
missing values and a planted signal (data/events_gen.py), from a proposed schema to scores.

One module-scoped run does the expensive part once: preprocess 4 days of events (split by
time: 2 days train, 1 validation, 1 test), train on 2 ranks with checkpoints, export. The
tests read it: the model learns, a resume on 1 rank continues it, predict on the raw test
day (Parquet and CSV) gives exactly the run's test evaluation. Beside it: schema inference,
bad rows and files, crafted manifests, sharded preprocessing with a share redone, progress
lines in a log, the --data_source example, and Criteo's shards byte for byte as before."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import PYTHON, REPO, cli, env_for_subprocess, evals, explain, one_line_error, read_metrics, run, torchrun
from torchrec_cloud.cli import main
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, generate, table_of, write_csv, write_events

ROWS_PER_DAY = 4000
SPLIT = ["--split_by", "ts", "--val_from", str(START + 2 * DAY_S), "--test_from", str(START + 3 * DAY_S)]
MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "32,8", "--over_arch_layer_sizes", "32,1",
         "--learning_rate", "0.05", "--batch_size", "300", "--no-progress", "--no-tensorboard",
         "--eval_every", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    root = tmp_path_factory.mktemp("events")
    info = write_events(str(root / "events"), days=4, rows_per_day=ROWS_PER_DAY, seed=0)
    write_csv(str(root / "day_3.csv"), generate(ROWS_PER_DAY, 3, 0))
    (root / "schema.yaml").write_text(SCHEMA)
    return root, info


@pytest.fixture(scope="module")
def trained(events):
    """Preprocessed, trained on 2 ranks (2 epochs, a checkpoint after each), exported."""
    root, info = events
    assert main(["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
                 str(root / "events"), "--output", str(root / "data"), "--rows_per_shard", "1500", *SPLIT]) == 0  # fmt: skip
    proc = torchrun(2, ["-m", "torchrec_cloud", "train", "--dataset_path", str(root / "data"), *MODEL,
                        "--num_epochs", "2", "--checkpoint_path", str(root / "ck"), "--checkpoint_interval", "13",
                        "--output_dir", str(root / "run")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    assert main(["export", str(root / "ck"), "--output", str(root / "model")]) == 0
    return root, info


def test_schema_is_proposed_from_parquet_and_csv(events, capsys, tmp_path):
    from torchrec_cloud.data.schema import load_schema

    root, _ = events
    for source in (root / "events" / "day_0.parquet", root / "day_3.csv"):
        out = tmp_path / f"{source.suffix[1:]}.yaml"
        rc, stdout, err = cli(capsys, "data", "schema", "--input", str(source), "--output", str(out))
        assert rc == 0, err
        schema = load_schema(str(out))  # loads as written, comments and all
        assert schema.label.column == "clicked" and schema.label.threshold is None
        assert schema.split is not None and schema.split.by == "ts"
        dense = {f.name: f.transform for f in schema.dense}
        sparse = {f.name: (f.type, f.list) for f in schema.sparse if f.mapping != "bucketize"}
        assert dense == {"price": "log1p", "views": "standardize"}, out.read_text()  # kept beside their buckets
        assert [f.name for f in schema.sparse if f.mapping == "bucketize"] == ["price", "views"], out.read_text()
        assert sparse == {"user": ("string", False), "item": ("int", False), "tags": ("string", True),
                          "recent": ("int", True)}, out.read_text()  # fmt: skip
        assert "% missing" in out.read_text()  # every column says what the sample held


def test_preprocessing_keeps_every_row_its_lists_and_its_split(trained):
    from torchrec_cloud.data.dataset import load_dataset
    from torchrec_cloud.data.reader import SchemaSource

    root, _ = trained
    assert main(["data", "verify", str(root / "data")]) == 0  # every shard against its checksum
    ds = load_dataset(str(root / "data"))
    splits = {k: sum(hi - lo for _, lo, hi in v) for k, v in ds.splits.items()}
    assert splits == {"train": 2 * ROWS_PER_DAY, "val": ROWS_PER_DAY, "test": ROWS_PER_DAY}
    transforms = ds.transforms()
    day3 = generate(ROWS_PER_DAY, 3, 0)
    assert len(transforms.vocab["user"]) <= len(set(day3["user"]) | set(generate(ROWS_PER_DAY, 0, 0)["user"]) | set(
        generate(ROWS_PER_DAY, 1, 0)["user"]))  # only ids seen in training rows  # fmt: skip
    # The test split's first rows, read back, hold the raw rows' tags (a list feature, with
    # its lengths) and recent items, and a missing price as log1p(0).
    source = SchemaSource(ds, batch_size=50, rank=0, world_size=1)
    batch, valid = next(source.eval_batches("test"))
    kjt = batch.sparse_features  # ids per feature counted on the host (data.keyed_jagged_tensor)
    assert kjt.length_per_key_or_none() == kjt.lengths().view(len(kjt.keys()), -1).sum(dim=1).tolist()
    tags = batch.sparse_features["tags"]
    lengths = tags.lengths().tolist()
    assert lengths == [len(t) for t in day3["tags"][:50]]
    inverse = ["?"] + transforms_vocab(transforms, "tags")
    got = tags.values().tolist()
    assert [inverse[i] for i in got[: lengths[0]]] == day3["tags"][0]
    recent = batch.sparse_features["recent"]
    assert recent.values().tolist()[: len(day3["recent"][0])] == day3["recent"][0]
    price = batch.dense_features[:, 0]
    missing = [i for i in range(50) if day3["price"][i] != day3["price"][i]]
    assert missing and all(float(price[i]) == 0.0 for i in missing)


def transforms_vocab(transforms, name: str) -> list:
    return [v for v, _ in sorted(transforms.vocab[name].items(), key=lambda kv: kv[1])]


def test_two_ranks_learn_the_planted_signal_and_the_start_record_names_the_schema(trained):
    root, info = trained
    records = read_metrics(root / "run")
    start = records[0]
    assert start["event"] == "start" and start["schema"]["name"] == "events" and start["world_size"] == 2
    assert start["config"]["model"]["feature_names"] == ["user", "item", "tags", "recent"]
    assert start["config"]["model"]["pooling"] == ["sum", "sum", "mean", "sum"]
    test = evals(records, "test")[-1]
    assert test["rows"] == ROWS_PER_DAY
    bayes = info["bayes_auc_by_day"][3]
    assert test["auc"] > 0.70 and test["auc"] > bayes - 0.12, (test, bayes)


def test_a_run_resumes_on_one_rank(trained, tmp_path):
    root, _ = trained
    first = sorted((root / "ck").glob("step_*"))[0]  # mid-run: the first epoch's checkpoint
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(root / "data"), *MODEL,
                "--num_epochs", "2", "--resume_from", str(first), "--output_dir", str(tmp_path / "resumed")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path / "resumed")
    resume = next(r for r in records if r["event"] == "resume")
    assert resume["saved_world_size"] == 2 and resume["world_size"] == 1 and resume["step"] == 13
    assert evals(records, "test")[-1]["auc"] > 0.68


def test_predict_on_raw_rows_equals_the_evaluation(trained, capsys, tmp_path):
    root, _ = trained
    test = evals(read_metrics(root / "run"), "test")[-1]
    config = json.loads((root / "model" / "model_config.json").read_text())
    assert config["schema"]["name"] == "events" and set(config["transforms"]["vocab"]) == {"user", "tags"}
    for raw in (root / "events" / "day_3.parquet", root / "day_3.csv"):
        rc, out, err = cli(capsys, "predict", str(root / "model"), "--input", str(raw), "--output",
                           str(tmp_path / "scores.csv"), "--json", "--no_progress")  # fmt: skip
        assert rc == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["rows"] == test["rows"] == ROWS_PER_DAY
        assert result["auc"] == pytest.approx(test["auc"], abs=1e-6), raw
        assert result["logloss"] == pytest.approx(test["logloss"], rel=1e-5), raw
    # New rows without the label, one with a user and tags never seen: scored, no AUC.
    cols = generate(20, 9, 0)
    cols["user"][0], cols["tags"][0] = "someone-new", ["never-seen"]
    table = table_of(cols).drop_columns(["clicked"])
    pq.write_table(table, tmp_path / "new.parquet")
    rc, out, err = cli(capsys, "predict", str(root / "model"), "--input", str(tmp_path / "new.parquet"),
                       "--output", str(tmp_path / "new.csv"), "--json", "--no_progress")  # fmt: skip
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rows"] == 20 and "auc" not in result
    lines = (tmp_path / "new.csv").read_text().splitlines()
    assert lines[0] == "probability" and len(lines) == 21 and all(0 < float(p) < 1 for p in lines[1:])


def test_a_bad_csv_row_names_its_line_and_column(events, capsys, tmp_path):
    root, _ = events
    lines = (root / "day_3.csv").read_text().splitlines(keepends=True)[:200]
    fields = lines[57].split(",")
    fields[5] = "cheap"  # price, line 58
    lines[57] = ",".join(fields)
    lines[120] = "1,2,3\n"  # a row with 3 fields, line 121
    bad = tmp_path / "bad.csv"
    bad.write_text("".join(lines))
    args = ["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input", str(bad),
            "--split_by", "hash:user", "--val_from", "0.8", "--test_from", "0.9"]  # fmt: skip
    line = one_line_error(capsys, 1, *args, "--output", str(tmp_path / "o1"))
    assert f"{bad}:58: column price: not a number: 'cheap'" in line and "--on_bad_line skip" in line, line
    rc, out, err = cli(capsys, *args, "--output", str(tmp_path / "o2"), "--on_bad_line", "skip")
    assert rc == 0, err
    assert "skipped 2 bad rows" in out and f"{bad}:121: expected 8 fields, found 3" in out, out
    assert json.loads((tmp_path / "o2" / "manifest.json").read_text())["rows"] == 197


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_a_csv_line_without_newline_is_an_error_not_a_memory_sink(trained, capsys, tmp_path, gz):
    """The 1 MiB cap on an input line holds for CSV too (pyarrow's block size): preprocessing
    and predict --input stop with one line after a block, whatever the line's length."""
    import gzip

    root, _ = trained
    header = (root / "day_3.csv").read_text().splitlines(keepends=True)[0].encode()
    data = header + b"1," + b"a" * (2 << 20)  # 2 MiB, no newline
    path = tmp_path / ("long.csv.gz" if gz else "long.csv")
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    said = f"{path}: a line after row 0 is longer than 1048576 bytes"
    line = one_line_error(capsys, 1, "data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"),
                          "--input", str(path), "--output", str(tmp_path / "o"), "--workers", "1")  # fmt: skip
    assert said in line, line
    line = one_line_error(capsys, 1, "predict", str(root / "model"), "--input", str(path), "--output",
                          str(tmp_path / "p.csv"), "--no_progress")  # fmt: skip
    assert said in line, line


def test_files_that_disagree_with_the_schema_are_named(events, capsys, tmp_path):
    root, _ = events
    table = pq.read_table(root / "events" / "day_0.parquet")
    pq.write_table(table.drop_columns(["views"]), tmp_path / "no_views.parquet")
    as_text = table.set_column(table.schema.get_field_index("item"), "item", pa.array(["x"] * len(table)))
    pq.write_table(as_text, tmp_path / "item_text.parquet")
    args = ["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--output", str(tmp_path / "o")]
    line = one_line_error(capsys, 1, *args, "--input", str(tmp_path / "no_views.parquet"))
    assert "no_views.parquet: column views named in the schema is not in the file" in line, line
    line = one_line_error(capsys, 1, *args[:-1], str(tmp_path / "o2"), "--input", str(tmp_path / "item_text.parquet"))
    assert "item_text.parquet: column item" in line and "schema" in line, line
    (tmp_path / "typo.yaml").write_text(SCHEMA.replace("transform: log1p", "transfrom: log1p"))
    line = one_line_error(capsys, 1, *args[:-1], str(tmp_path / "o3"), "--schema", str(tmp_path / "typo.yaml"),
                          "--input", str(root / "day_3.csv"))  # fmt: skip
    assert "typo.yaml: dense[0].transfrom: unknown key" in line, line


def test_crafted_manifests_are_refused_with_one_line(trained, capsys, tmp_path):
    root, _ = trained
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    cases = {
        "absolute": (lambda m: m["shards"][0].update(path="/etc/hostname"), "shards[0].path: /etc/hostname is not a name inside its folder"),
        "parent": (lambda m: m["shards"][0].update(path="shards/../../x.bin"), "shards[0].path"),
        "huge": (lambda m: m["shards"][0].update(rows=10**15), "shards[0].rows: must be an integer in"),
        "negative": (lambda m: m["shards"][1].update(rows=-5), "shards[1].rows: must be an integer in"),
        "size": (lambda m: m["shards"][0].update(bytes=m["shards"][0]["bytes"] + 8), "shards[0].bytes: is"),
        "vocab": (lambda m: m["transforms"]["vocab"]["user"].update(path="vocab/x/../../y"), "transforms.vocab.user.path"),
        "split": (lambda m: m["splits"]["train"].append([999, 0, 1]), "splits.train"),
        "escape": (lambda m: m.update(format="\x1b[31mevil"), "\\x1b[31mevil"),
    }  # fmt: skip
    for name, (damage, expected) in cases.items():
        folder = tmp_path / name
        shutil.copytree(root / "data", folder)
        m = json.loads(json.dumps(manifest))
        damage(m)
        (folder / "manifest.json").write_text(json.dumps(m))
        line = one_line_error(capsys, 1, "data", "verify", str(folder))
        assert expected in line and "\x1b" not in line, (name, line)
        proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(folder), *MODEL,
                    "--output_dir", str(tmp_path / "r")]) if name == "absolute" else None  # fmt: skip
        if proc is not None:
            assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, explain(proc)


def test_sharded_preprocessing_with_a_share_redone(events, capsys, tmp_path):
    """Two shares side by side (as an Indexed Job's pods): the same dataset as one run; a share
    lost after its work was partly done is run again and the manifest comes back the same."""
    root, _ = events
    base = ["-m", "torchrec_cloud", "data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"),
            "--input", str(root / "events"), "--rows_per_shard", "1500", *SPLIT]  # fmt: skip
    assert main(base[2:] + ["--output", str(tmp_path / "whole")]) == 0
    out = str(tmp_path / "shared")
    env = env_for_subprocess()
    procs = [subprocess.Popen([PYTHON, *base, "--output", out, "--shares", "2"], env={**env, "JOB_COMPLETION_INDEX": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]  # fmt: skip
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr
    whole = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    shared = json.loads((tmp_path / "shared" / "manifest.json").read_text())
    assert shared == whole
    for shard in whole["shards"]:
        assert (tmp_path / "shared" / shard["path"]).read_bytes() == (tmp_path / "whole" / shard["path"]).read_bytes()
    # Share 1 (inputs 1 and 3) is lost after converting part of input 3: its record, one
    # shard and the manifest are gone, as after a pod killed mid-way.
    shared_dir = Path(out)
    (shared_dir / "manifest.json").unlink()
    (shared_dir / "_sources" / "00003-day_3.json").unlink()
    for name in ("00003-day_3-00001.bin", "00003-day_3-00001.bin.done"):
        (shared_dir / "shards" / name).unlink()
    rc, stdout, err = cli(capsys, *base[2:], "--output", out, "--shares", "2", "--share_index", "1")
    assert rc == 0, err
    assert json.loads((shared_dir / "manifest.json").read_text()) == whole


def test_progress_is_plain_lines_in_a_log(events, capsys, tmp_path, monkeypatch):
    from torchrec_cloud import progress

    root, _ = events
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    rc, out, err = cli(capsys, "data", "preprocess", "--schema", str(root / "schema.yaml"), "--input",
                       str(root / "day_3.csv"), "--output", str(tmp_path / "o"), "--workers", "1")  # fmt: skip
    assert rc == 0, err
    assert "\r" not in err and err.splitlines()[-1].startswith("preprocess: ") and " rows/s)" in err, err


def test_the_data_source_example_trains(tmp_path):
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--data_source", "examples/custom_source.py:make_source",
                "--num_dense_features", "4", "--num_sparse_features", "3", "--num_embeddings", "1000",
                *MODEL[:8], "--batch_size", "500", "--num_batches_per_epoch", "16", "--no-progress",
                "--no-tensorboard", "--output_dir", str(tmp_path / "run")], cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    test = evals(read_metrics(tmp_path / "run"), "test")[-1]
    assert test["rows"] == 800 and test["auc"] > 0.65, test
    bad = run([PYTHON, "-m", "torchrec_cloud", "train", "--data_source", "examples/custom_source.py:nothing"], cwd=REPO)
    assert bad.returncode == 2 and "--data_source: examples/custom_source.py has no function 'nothing'" in bad.stderr


# Checksums of the shards main's code (bdf92ec) wrote for this generated file: Criteo's
# preprocessing is a contract (TorchRec's parity), and its shards must not change.
CRITEO_TSV_SHA256 = "baee1bd2bedca8599f327524d05ec7d2b9ca34e898eab7c67c66a7d8567a43d6"
CRITEO_SHARDS = {
    "sized": ["3995480baea9044d", "bdb09bc4700d8ba3", "13c8ea1194be0519", "a92a6be1aa120eda"],
    "raw": ["12c1f0236a2ab03c", "5740dec5eb07cf3c", "8fb486b826197935", "ad5b69ea0d2ccdc2"],
}


def test_criteo_shards_are_byte_for_byte_as_before(tmp_path):
    from torchrec_cloud import checksum
    from torchrec_cloud.data.criteo_gen import write_criteo_tsv

    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=1500, seed=3)
    assert hashlib.sha256(tsv.read_bytes()).hexdigest() == CRITEO_TSV_SHA256  # the same input as then
    sizes = ",".join(map(str, [97, 1000, 5, 20000, 333] + [1000] * 21))
    for name, extra in (("sized", ["--num_embeddings_per_feature", sizes]), ("raw", [])):
        out = tmp_path / name
        assert main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(tsv), "--output",
                     str(out), "--chunk_mb", "0.1", "--workers", "1", *extra]) == 0  # fmt: skip
        manifest = json.loads((out / "manifest.json").read_text())
        digests = [checksum.file_digest(str(out / s["path"]))[1] for s in manifest["shards"]]
        assert digests == CRITEO_SHARDS[name]


def test_every_command_reports_errors_in_one_place(capsys, tmp_path):
    """cli.main prints every command's CommandError as one line with the command's full name."""
    missing = str(tmp_path / "nothing")
    cases = [
        (["data", "verify", missing], "torchrec-cloud data verify: error: "),
        (["data", "schema", "--input", missing + ".parquet"], "torchrec-cloud data schema: error: "),
        (["predict", missing, "--input", "x.parquet", "--output", str(tmp_path / "o.csv")], "torchrec-cloud predict: error: "),
        (["export", missing, "--output", str(tmp_path / "m")], "torchrec-cloud export: error: "),
        (["checkpoint", "inspect", "s3x://bucket/ck"], "torchrec-cloud checkpoint inspect: error: "),
        (["checkpoint", "ls", missing], "torchrec-cloud checkpoint ls: error: "),
        (["checkpoint", "verify", missing], "torchrec-cloud checkpoint verify: error: "),
    ]  # fmt: skip
    for argv, prefix in cases:
        line = one_line_error(capsys, 1, *argv)
        assert line.startswith(prefix), (argv, line)


def test_events_in_a_bucket_split_by_input_file(events, s3_service, monkeypatch, capsys, tmp_path):
    """Parquet and CSV inputs read from S3 (moto's server), shards written there, split by
    input file (named by file name), read back, and raw rows scored from the bucket."""
    from torchrec_cloud import storage
    from torchrec_cloud.data.dataset import load_dataset
    from torchrec_cloud.data.reader import SchemaSource

    root, _ = events
    for key, value in s3_service.env.items():
        monkeypatch.setenv(key, value)
    bucket = f"{s3_service.url}/own-data"
    for name in ("day_0.parquet", "day_1.parquet"):
        storage.write_bytes(f"{bucket}/raw/{name}", (root / "events" / name).read_bytes())
    storage.write_bytes(f"{bucket}/raw/day_3.csv", (root / "day_3.csv").read_bytes())
    rc, out, err = cli(capsys, "data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"),
                       "--input", f"{bucket}/raw/", "--output", f"{bucket}/shards", "--split_by", "input",
                       "--val_from", "day_1.parquet", "--test_from", "day_3.csv", "--workers", "1")  # fmt: skip
    assert rc == 0, err
    ds = load_dataset(f"{bucket}/shards")
    rows = {k: sum(hi - lo for _, lo, hi in v) for k, v in ds.splits.items()}
    assert rows == {"train": ROWS_PER_DAY, "val": ROWS_PER_DAY, "test": ROWS_PER_DAY}
    batch, valid = next(SchemaSource(ds, batch_size=64, rank=0, world_size=1).eval_batches("test"))
    assert valid == 64 and batch.sparse_features["tags"].lengths().tolist() == [len(t) for t in generate(ROWS_PER_DAY, 3, 0)["tags"][:64]]
