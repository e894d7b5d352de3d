"""Transforms pinned from training to scoring (issue #39): a checkpoint records the digest of
the transforms it trained with, and ``export`` and ``predict`` take transforms only from data
with that digest, whatever folder a COMMIT.json (untrusted) or ``--dataset_path`` names; ``data
verify`` and ``train`` read every vocabulary against its manifest before a step.

One module-scoped run does the expensive part once: the planted events of
:mod:`torchrec_cloud.data.events_gen` preprocessed twice (the same rows, split at different
days, so other vocabularies and statistics), one short 1-rank run with a checkpoint on the
first, exported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import PYTHON, cli, explain, one_line_error, read_metrics, run
from torchrec_cloud.cli import main
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, generate, write_csv, write_events
from torchrec_cloud.train import run as train

ROWS_PER_DAY = 600
MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
         "--batch_size", "200", "--no-progress", "--no-tensorboard", "--eval_every", "0"]  # fmt: skip


def split_at(val_day: int) -> list[str]:
    return ["--split_by", "ts", "--val_from", str(START + val_day * DAY_S), "--test_from", str(START + 3 * DAY_S)]


def preprocess(root: Path, output: Path, val_day: int) -> None:
    assert main(["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
                 str(root / "events"), "--output", str(output), *split_at(val_day)]) == 0  # fmt: skip


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """``data`` (train on days 0-1) and ``other`` (train on day 0 only), a checkpoint of a run on
    ``data``, and its export."""
    root = tmp_path_factory.mktemp("pinned")
    write_events(str(root / "events"), days=4, rows_per_day=ROWS_PER_DAY, seed=1)
    (root / "schema.yaml").write_text(SCHEMA)
    preprocess(root, root / "data", 2)
    preprocess(root, root / "other", 1)
    train(parse_job_config(["--dataset_path", str(root / "data"), *MODEL, "--num_epochs", "1",
                            "--checkpoint_path", str(root / "ck"), "--output_dir", str(root / "run")]))  # fmt: skip
    assert main(["export", str(root / "ck"), "--output", str(root / "model")]) == 0
    return root


def commit_of(folder: Path) -> tuple[Path, dict]:
    path = next(folder.glob("step_*")) / "COMMIT.json"
    return path, json.loads(path.read_text())


def copied_checkpoint(root: Path, tmp_path: Path, edit) -> Path:
    """A copy of the run's checkpoint whose COMMIT.json ``edit`` changed."""
    shutil.copytree(root / "ck", tmp_path / "ck")
    path, commit = commit_of(tmp_path / "ck")
    edit(commit)
    path.write_text(json.dumps(commit))
    return tmp_path / "ck"


def test_the_run_its_checkpoint_and_its_model_record_one_digest(pinned):
    start = read_metrics(pinned / "run")[0]
    digest = start["pinned_transforms"]["digest"]
    assert start["pinned_transforms"]["kind"] == "schema" and len(digest) == 64
    assert commit_of(pinned / "ck")[1]["pinned_transforms"]["digest"] == digest
    assert json.loads((pinned / "model" / "model_config.json").read_text())["pinned_transforms"]["digest"] == digest
    other = json.loads((pinned / "other" / "manifest.json").read_text())
    data = json.loads((pinned / "data" / "manifest.json").read_text())
    assert other["transforms"]["vocab"]["user"]["xxh3_64"] != data["transforms"]["vocab"]["user"]["xxh3_64"]


def test_export_refuses_another_datasets_transforms(pinned, capsys, tmp_path):
    digest = commit_of(pinned / "ck")[1]["pinned_transforms"]["digest"]
    line = one_line_error(capsys, 1, "export", str(pinned / "ck"), "--output", str(tmp_path / "m"),
                          "--dataset_path", str(pinned / "other"))  # fmt: skip
    assert digest[:16] in line and str(pinned / "other") in line and "--dataset_path" in line, line
    from torchrec_cloud.data.dataset import load_dataset

    assert load_dataset(str(pinned / "other")).digest[:16] in line, line
    assert not (tmp_path / "m").exists()
    # The quantization check on the dataset it trained on, named explicitly, is fine.
    rc, _, err = cli(capsys, "export", str(pinned / "ck"), "--output", str(tmp_path / "q"), "--quantize", "fp16",
                     "--dataset_path", str(pinned / "data"))  # fmt: skip
    assert rc == 0, err
    assert "auc_change" in json.loads((tmp_path / "q" / "model_config.json").read_text())["quantization"]


def test_a_commit_naming_another_folder_is_refused(pinned, capsys, tmp_path):
    def other_path(commit: dict) -> None:
        commit["config"]["data"]["dataset_path"] = str(pinned / "other")

    line = one_line_error(capsys, 1, "export", str(copied_checkpoint(pinned, tmp_path, other_path)), "--output",
                          str(tmp_path / "m"))  # fmt: skip
    assert "not the data it trained on" in line and "COMMIT.json names this folder" in line, line
    assert not (tmp_path / "m").exists()


def test_a_commit_without_its_digest_copies_no_transforms(pinned, capsys, tmp_path):
    ck = copied_checkpoint(pinned, tmp_path, lambda commit: commit.pop("pinned_transforms"))
    line = one_line_error(capsys, 1, "export", str(ck), "--output", str(tmp_path / "m"))
    assert "records no transforms it was trained with" in line, line


def test_a_dataset_rebuilt_in_place_with_another_split_is_refused(pinned, capsys, tmp_path):
    """A checkpoint whose dataset folder holds a copy of the data it trained on exports (the
    digest is of the transforms, not of the folder); rebuilt there with another split, not."""
    shutil.copytree(pinned / "data", tmp_path / "data")

    def moved(commit: dict) -> None:
        commit["config"]["data"]["dataset_path"] = str(tmp_path / "data")

    ck = copied_checkpoint(pinned, tmp_path, moved)
    assert cli(capsys, "export", str(ck), "--output", str(tmp_path / "m1"))[0] == 0
    shutil.rmtree(tmp_path / "data")
    preprocess(pinned, tmp_path / "data", 1)
    line = one_line_error(capsys, 1, "export", str(ck), "--output", str(tmp_path / "m2"))
    assert "not the data it trained on" in line, line


def test_predict_checks_the_transforms_it_loads(pinned, capsys, tmp_path):
    raw = pinned / "events" / "day_3.parquet"
    rc, out, err = cli(capsys, "predict", str(pinned / "model"), "--input", str(raw), "--output",
                       str(tmp_path / "s.csv"), "--json", "--no_progress")  # fmt: skip
    assert rc == 0, err
    # The model folder's statistics replaced by another dataset's: refused, not scored.
    model = tmp_path / "model"
    shutil.copytree(pinned / "model", model)
    config = json.loads((model / "model_config.json").read_text())
    other = json.loads((pinned / "other" / "manifest.json").read_text())
    config["transforms"]["dense_stats"] = other["transforms"]["dense_stats"]
    (model / "model_config.json").write_text(json.dumps(config))
    line = one_line_error(capsys, 1, "predict", str(model), "--input", str(raw), "--output", str(tmp_path / "x.csv"))
    assert config["pinned_transforms"]["digest"][:16] in line and "export the checkpoint again" in line, line
    # Shards of another dataset: their ids are other vocabularies' rows.
    line = one_line_error(capsys, 1, "predict", str(pinned / "model"), "--dataset_path", str(pinned / "other"),
                          "--split", "test", "--output", str(tmp_path / "y.csv"))  # fmt: skip
    assert "not the data it trained on" in line, line
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "y.csv").exists()
    rc, _, err = cli(capsys, "predict", str(pinned / "model"), "--dataset_path", str(pinned / "data"), "--split",
                     "test", "--output", str(tmp_path / "z.csv"), "--no_progress")  # fmt: skip
    assert rc == 0, err


def test_predicts_bad_row_hint_names_a_flag_it_takes(pinned, capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    write_csv(str(bad), generate(20, 3, 0))
    lines = bad.read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split(",")
    cells = lines[5].rstrip("\n").split(",")
    cells[header.index("price")] = "cheap"
    lines[5] = ",".join(cells) + "\n"
    bad.write_text("".join(lines))
    line = one_line_error(capsys, 1, "predict", str(pinned / "model"), "--input", str(bad), "--output",
                          str(tmp_path / "s.csv"))  # fmt: skip
    assert f"{bad}:6:" in line and "price" in line and "--on_bad_line skip" in line, line
    rc, _, err = cli(capsys, "predict", str(pinned / "model"), "--input", str(bad), "--output",
                     str(tmp_path / "s.csv"), "--on_bad_line", "skip", "--no_progress")  # fmt: skip
    assert rc == 0, err


@pytest.mark.parametrize("damage", ["reversed", "deleted"])
def test_a_damaged_vocabulary_stops_verify_and_train_before_a_step(pinned, capsys, tmp_path, damage):
    data = tmp_path / "data"
    shutil.copytree(pinned / "data", data)
    vocab = data / "vocab" / "user.json"
    doc = json.loads(vocab.read_text())
    if damage == "reversed":  # the same bytes, the same count: only the checksum tells
        text = vocab.read_text()
        vocab.write_text(text.replace(json.dumps(doc["values"]), json.dumps(doc["values"][::-1])))
        assert len(vocab.read_bytes()) == len(text.encode())
    else:
        vocab.unlink()
    line = one_line_error(capsys, 1, "data", "verify", str(data))
    assert "vocab/user.json" in line and ("checksum" in line if damage == "reversed" else "missing" in line), line
    line = one_line_error(capsys, 2, "train", "--dataset_path", str(data), *MODEL, "--output_dir", str(tmp_path / "r"))
    assert "vocab/user.json" in line, line
    assert not list(tmp_path.glob("r*/metrics.jsonl"))  # stopped before the run's first record


def test_a_vocabulary_larger_than_its_file_is_refused(pinned, capsys, tmp_path):
    """A manifest claiming 3,000,000 user ids beside a file of a few KB: verify, plan and
    train refuse it from the manifest alone, before a table of that size is planned."""
    data = tmp_path / "data"
    shutil.copytree(pinned / "data", data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["schema"]["sparse"][0]["num_embeddings"] = 4_000_000
    manifest["transforms"]["vocab"]["user"]["size"] = 3_000_000
    manifest["transforms"]["table_sizes"][0] = 3_000_001
    (data / "manifest.json").write_text(json.dumps(manifest))
    expected = "transforms.vocab.user.size: 3000000 distinct ids cannot fit"
    assert expected in one_line_error(capsys, 1, "data", "verify", str(data))
    proc = run([PYTHON, "-m", "torchrec_cloud", "plan", "--dataset_path", str(data), "--batch_size", "200"])
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
    line = one_line_error(capsys, 2, "train", "--dataset_path", str(data), *MODEL, "--output_dir", str(tmp_path / "r"))
    assert expected in line, line


def test_an_unquoted_date_bound_is_that_date():
    from torchrec_cloud.data.schema import parse_schema
    from torchrec_cloud.untrusted import parse_yaml

    def split(bounds: str):
        return parse_schema(parse_yaml(SCHEMA + f"split: {{by: day, {bounds}}}\n", "s.yaml"), "s.yaml").split

    # The schema loader keeps a YAML date as the text written (docs/data.md), the same bound
    # as the quoted one.
    unquoted = split("val_from: 2024-03-01, test_from: 2024-03-02 12:00:00")
    quoted = split("val_from: '2024-03-01', test_from: '2024-03-02 12:00:00'")
    assert unquoted == quoted and unquoted.val_from == "2024-03-01"


def test_resuming_on_other_transforms_says_so_and_pins_the_new_ones(pinned, tmp_path):
    """The same tables, other statistics (the dataset rebuilt from other rows): the resume is
    allowed, with a warning naming both digests, and its checkpoints pin the new transforms."""
    from torchrec_cloud.checkpoint import CheckpointWarning

    data = tmp_path / "data"
    shutil.copytree(pinned / "data", data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["transforms"]["dense_stats"]["views"]["mean"] += 1.0
    (data / "manifest.json").write_text(json.dumps(manifest))
    step = next((pinned / "ck").glob("step_*"))
    with pytest.warns(CheckpointWarning, match="transforms have digest") as caught:
        train(parse_job_config(["--dataset_path", str(data), *MODEL, "--num_epochs", "1", "--resume_from", str(step),
                                "--checkpoint_path", str(tmp_path / "ck"), "--output_dir", str(tmp_path / "run")]))  # fmt: skip
    old = commit_of(pinned / "ck")[1]["pinned_transforms"]["digest"]
    new = commit_of(tmp_path / "ck")[1]["pinned_transforms"]["digest"]
    assert new != old and any(old[:16] in str(w.message) and new[:16] in str(w.message) for w in caught)
