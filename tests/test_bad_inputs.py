"""Every bad input we know of, run as a user runs it: each ends with one line that says what
and where, a non-zero exit, and no traceback.

Most cases call the command line in this process (``cli.main``, as the console script does:
an exception escaping it would fail the test as a traceback would reach the user); the ones
where a traceback could escape elsewhere (training, whose errors may start in another thread
or after the model is built) also run as a subprocess. The multi-rank damaged-checkpoint
case is in test_checkpoint_resume.py; the CRLF and bad-line cases of preprocessing, with the
outputs they produce, in test_criteo.py.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

from checkpoint_runs import TINY, flip_bytes, run
from helpers import free_port
from torchrec_cloud import cli
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.criteo_gen import write_criteo_tsv
from torchrec_cloud.train import run as train

CRITEO_MODEL = ["--num_embeddings", "1000", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
                "--over_arch_layer_sizes", "16,1", "--batch_size", "64", "--no-progress", "--no-tensorboard"]  # fmt: skip
# AWS_MAX_ATTEMPTS=1: botocore's retries of a refused connection only delay the same line.
CLOSED_S3 = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1"}  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small preprocessed Criteo folder with several shards."""
    work = tmp_path_factory.mktemp("data")
    write_criteo_tsv(str(work / "train.txt"), rows=1500, seed=3)
    assert cli.main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(work / "train.txt"),
                     "--output", str(work / "ok"), "--num_embeddings", "1000", "--chunk_mb", "0.1",
                     "--workers", "1"]) == 0  # fmt: skip
    return work / "ok"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A tiny 1-rank run's folder of checkpoints (steps 3 and 6)."""
    out = tmp_path_factory.mktemp("ckpt-run")
    train(parse_job_config([*TINY, "--output_dir", str(out), "--num_batches_per_epoch", "6",
                            "--checkpoint_interval", "3", "--checkpoint_path", str(out / "ckpt")]))  # fmt: skip
    return out / "ckpt"


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


def first_shard(folder: Path) -> Path:
    return folder / json.loads((folder / "manifest.json").read_text())["shards"][0]["path"]


def assert_one_line(code: int, err: str, expected_code: int, *expected: str) -> None:
    """The user's view: a non-zero exit and, last on stderr (after any library warnings), one
    ``torchrec-cloud ...`` line holding ``expected``; no traceback anywhere."""
    assert code == expected_code, f"exit {code}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("torchrec-cloud")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err[-3000:]
    for text in expected:
        assert text in errors[0], errors[0]


def cli_error(capsys, expected_code: int, argv: list[str], *expected: str) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert_one_line(code, err, expected_code, *expected)
    return err


def damaged_shard(dataset: Path, tmp_path: Path, how: str) -> tuple[Path, Path]:
    folder = copy_of(dataset, tmp_path)
    shard = first_shard(folder)
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:
        flip_bytes(shard, 64)
    return folder, shard


# -- data -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_training_on_a_damaged_shard(dataset, tmp_path, capsys, how):
    """Missing or truncated: found at start-up, by size. Flipped (size unchanged): an id
    outside its table stops the run at that batch, pointing at data verify."""
    folder, shard = damaged_shard(dataset, tmp_path, how)
    argv = ["train", "--dataset_path", str(folder), *CRITEO_MODEL, "--output_dir", str(tmp_path / "run")]
    expected = {
        "missing": (str(shard), "is missing"),
        "truncated": (str(shard), "has 1000 bytes, the manifest says"),
        "flipped": (f"{folder}: a row has id ", "a shard is damaged", f"data verify {folder}"),
    }[how]
    cli_error(capsys, 2, argv, "--dataset_path", *expected)
    if how == "missing":  # one real process too: what a user sees (the others take the same path)
        assert_one_line(*subprocess_result([sys.executable, "-m", "torchrec_cloud", *argv]), 2, *expected)


def subprocess_result(cmd: list[str], env: dict | None = None) -> tuple[int, str]:
    proc = run(cmd, timeout=300, extra_env=env)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_data_verify_names_the_damaged_shard(dataset, tmp_path, capsys, how):
    shards = len(json.loads((dataset / "manifest.json").read_text())["shards"])
    assert shards > 1 and cli.main(["data", "verify", str(dataset)]) == 0
    assert f"ok: {shards} shards" in capsys.readouterr().out
    folder, shard = damaged_shard(dataset, tmp_path, how)
    code = cli.main(["data", "verify", str(folder)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if str(shard) in line]
    assert {"missing": ": missing", "truncated": "1000 bytes", "flipped": "checksum mismatch"}[how] in line


def test_bad_manifests(dataset, tmp_path, capsys):
    argv = ["train", *CRITEO_MODEL, "--output_dir", str(tmp_path / "run"), "--dataset_path"]
    cli_error(capsys, 2, [*argv, str(tmp_path / "nothing")], "manifest.json not found", "data preprocess")
    folder = copy_of(dataset, tmp_path)
    (folder / "manifest.json").write_bytes(b'{"format": "torchrec-cloud-criteo-shards", "vers')
    cli_error(capsys, 2, [*argv, str(folder)], "--dataset_path", "manifest.json is not valid JSON")
    cli_error(capsys, 1, ["data", "verify", str(folder)], "manifest.json is not valid JSON")
    cli_error(capsys, 1, ["data", "verify", str(tmp_path / "nothing")], "manifest.json not found", "data preprocess")


@pytest.mark.parametrize("record", ["_plan.json", "manifest.json"])
def test_preprocessing_again_over_damaged_records(dataset, tmp_path, capsys, record):
    """The same command run again (to resume, or to see the result) reads what it wrote."""
    folder = copy_of(dataset, tmp_path)
    (folder / record).write_bytes(b'{"format": ')
    cli_error(capsys, 1, ["data", "preprocess", "--no_progress", "--format", "kaggle", "--input",
                          str(dataset.parent / "train.txt"), "--output", str(folder), "--num_embeddings", "1000",
                          "--chunk_mb", "0.1", "--workers", "1"], f"{folder / record} is damaged")  # fmt: skip


@pytest.mark.parametrize("damage", ["_plan.json", "manifest.json", "settings"])
def test_a_schemas_preprocessing_again_is_checked_as_criteos(tmp_path, capsys, damage):
    """Both input formats' runs start from the same plan check: a damaged record or other
    settings over a finished run get the same one line as Criteo's."""
    from torchrec_cloud.data.events_gen import SCHEMA, write_events

    write_events(str(tmp_path / "events"), days=1, rows_per_day=300, seed=1)
    (tmp_path / "schema.yaml").write_text(SCHEMA)
    folder = tmp_path / "out"
    argv = ["data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(tmp_path / "schema.yaml"),
            "--input", str(tmp_path / "events"), "--output", str(folder)]  # fmt: skip
    assert cli.main(argv) == 0
    capsys.readouterr()
    if damage == "settings":
        cli_error(capsys, 1, [*argv, "--rows_per_shard", "7"], "holds a preprocessing run with different settings",
                  "rows_per_shard")  # fmt: skip
    else:
        (folder / damage).write_bytes(b'{"format": ')
        cli_error(capsys, 1, argv, f"{folder / damage} is damaged")


def test_bad_preprocessing_inputs(tmp_path, capsys):
    good = tmp_path / "train.txt"
    write_criteo_tsv(str(good), rows=300, seed=1)
    lines = good.read_text().splitlines(keepends=True)

    def preprocess(code: int, name: str, text: str | bytes | None, *expected: str, output: str | None = None) -> None:
        path = tmp_path / name
        if text is not None:
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
        out = output or str(tmp_path / f"out-{name}")
        cli_error(capsys, code, ["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(path),
                                 "--output", out], *expected)  # fmt: skip

    preprocess(1, "bad_line.txt", "".join(lines[:7] + ["1\t2\t3\n"] + lines[7:]), "bad_line.txt:8: expected 40")
    field = lines[4].split("\t")
    field[20] = field[20] + "\r"  # a \r that does not end the line stays an error
    preprocess(1, "cr.txt", "".join(lines[:4] + ["\t".join(field)] + lines[5:]), "cr.txt:5: categorical feature")
    preprocess(1, "empty.txt", "", "empty.txt: the file is empty")
    preprocess(1, "missing.txt", None, "missing.txt", "not found")
    preprocess(1, "cut.gz", gzip.compress(good.read_bytes())[:2000], "cut.gz: truncated gzip file")
    preprocess(1, "notgz.gz", b"plain text, not gzip\n", "notgz.gz: not a valid gzip file")
    # an output folder that cannot be made (its parent is a file: root cannot either)
    preprocess(1, "train.txt", None, str(good / "out"), output=str(good / "out"))


def test_bad_flags(capsys, tmp_path):
    cli_error(capsys, 2, ["train", "--batch_size", "0"], "--batch_size")
    cli_error(capsys, 2, ["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag")
    cli_error(capsys, 2, ["train", "--resume_from", " "], "--resume_from", "must not be empty")
    cli_error(capsys, 2, ["train", "--checkpoint_path", "hdfs://x/y"], "--checkpoint_path", "unsupported URL scheme")
    cli_error(capsys, 2, ["data", "preprocess", "--input", "x"], "--format")
    cli_error(capsys, 2, ["data", "preprocess", "--format", "kaggle", "--input", "x", "--output", "y",
                          "--num_embeddings", "0"], "--num_embeddings")  # fmt: skip
    cli_error(capsys, 2, ["checkpoint", "verify"], "PATH")
    cli_error(capsys, 2, ["data", "verify"], "DIR_OR_URL")


# -- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("damaged", ["__0_0.distcp", ".metadata"])
def test_resume_from_a_damaged_checkpoint(checkpoints, tmp_path, capsys, damaged):
    root = copy_of(checkpoints, tmp_path)
    newest = root / "step_00000006"
    flip_bytes(newest / damaged)
    argv = ["train", *TINY, "--num_batches_per_epoch", "6", "--output_dir", str(tmp_path / "run"),
            "--resume_from", str(newest)]  # fmt: skip
    expected = ("--resume_from", f"{newest} is damaged: {damaged}: bytes ", "checksum mismatch")
    cli_error(capsys, 2, argv, *expected)
    if damaged.endswith(".distcp"):  # found while loading, after the model is built
        assert_one_line(*subprocess_result([sys.executable, "-m", "torchrec_cloud", *argv]), 2, *expected)
    cli_error(capsys, 1, ["checkpoint", "verify", str(newest)], f"{newest}: DAMAGED: {damaged}: bytes ")
    assert cli.main(["checkpoint", "inspect", "--verify", str(newest)]) == 1
    assert f"status      DAMAGED: {damaged}: bytes " in capsys.readouterr().out


def test_missing_checkpoints(tmp_path, capsys):
    cli_error(capsys, 1, ["checkpoint", "verify", str(tmp_path / "nope")], "does not exist")
    cli_error(capsys, 1, ["checkpoint", "ls", str(tmp_path / "nope")], "does not exist")
    cli_error(capsys, 1, ["checkpoint", "inspect", str(tmp_path)], "not a checkpoint")
    cli_error(capsys, 2, ["train", *TINY, "--output_dir", str(tmp_path / "r"), "--resume_from", str(tmp_path / "no")],
              "--resume_from", "does not exist")  # fmt: skip


def test_unwritable_output_folders(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    argv = ["train", *TINY, "--num_batches_per_epoch", "2"]
    cli_error(capsys, 2, [*argv, "--output_dir", str(a_file / "run")], "--output_dir", "cannot write metrics")
    cli_error(capsys, 2, [*argv, "--output_dir", str(tmp_path / "run"), "--checkpoint_path", str(a_file / "ckpt")],
              "--checkpoint_path", "cannot write checkpoints")  # fmt: skip


def test_unreachable_buckets(monkeypatch, tmp_path, capsys):
    """A closed port on 127.0.0.1 as the S3 endpoint: every command says the service is unreachable."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    for key, value in CLOSED_S3.items():
        monkeypatch.setenv(key, value)
    url = "s3://bucket/x"
    cli_error(capsys, 2, ["train", *CRITEO_MODEL, "--output_dir", str(tmp_path / "r"), "--dataset_path", url],
              "--dataset_path", url, "unreachable")  # fmt: skip
    cli_error(capsys, 1, ["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", f"{url}/train.txt",
                          "--output", str(tmp_path / "o")], url, "unreachable")  # fmt: skip
    cli_error(capsys, 2, ["train", *TINY, "--output_dir", str(tmp_path / "r2"), "--checkpoint_path", url],
              "--checkpoint_path", url, "unreachable")  # fmt: skip
    cli_error(capsys, 1, ["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", __file__,
                          "--output", url], url, "unreachable")  # fmt: skip
    cli_error(capsys, 1, ["checkpoint", "ls", url], url, "unreachable")
    cli_error(capsys, 1, ["checkpoint", "verify", url], url, "unreachable")
