"""Commands that take the same things take them the same way: a run folder wherever a folder
of checkpoints is taken, predict checking only the split it scores, a damaged checkpoint
failing every listing that reads it back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env_for_subprocess
from torchrec_cloud.cli import main


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def in_run_folder(tiny_run_folder, monkeypatch):
    """The doc examples' folder as the working directory: `runs/q` is a run folder."""
    monkeypatch.chdir(tiny_run_folder)
    return tiny_run_folder


def test_export_takes_a_run_folder_as_checkpoint_ls_does(in_run_folder, tmp_path, capsys):
    code, out, err = cli(capsys, "checkpoint", "ls", "runs/q")
    assert code == 0 and "step_00000020" in out, err
    code, out, err = cli(capsys, "export", "runs/q", "--output", str(tmp_path / "model"), "--json")
    assert code == 0, err
    exported = json.loads(out.strip().splitlines()[-1])
    assert exported["checkpoint"]["step"] == 20  # the newest complete checkpoint its run wrote
    assert "is_fx_tracing" not in err  # torch's notice about its own internals
    assert "(step 20, 1 rank)" in err  # one rank, not "1 ranks"


def test_predict_checks_only_the_split_it_scores(in_run_folder, tmp_path, capsys):
    """Shards with fewer training rows than one batch: training refuses them, but the test
    split can be scored (predict's batches need not fill one)."""
    from torchrec_cloud.data.criteo_gen import write_criteo_tsv

    write_criteo_tsv(str(tmp_path / "small.txt"), rows=70, seed=3, vocab=50)  # 60 train, 5 val, 5 test
    done = subprocess.run([sys.executable, "-m", "torchrec_cloud", "data", "preprocess", "--format", "kaggle",
                           "--input", str(tmp_path / "small.txt"), "--output", str(tmp_path / "shards"),
                           "--num_embeddings", "100", "--workers", "1", "--no-progress"],
                          env=env_for_subprocess(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    code, _, err = cli(capsys, "export", "runs/q", "--output", str(tmp_path / "model"))
    assert code == 0, err
    code, out, err = cli(capsys, "predict", str(tmp_path / "model"), "--dataset_path", str(tmp_path / "shards"),
                         "--split", "test", "--output", str(tmp_path / "test.csv"), "--json", "--no_progress")  # fmt: skip
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["rows"] == 5
    assert len((tmp_path / "test.csv").read_text().splitlines()) == 1 + 5


def test_checkpoint_ls_verify_fails_on_a_damaged_checkpoint(tiny_run_folder, tmp_path, capsys):
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_run_folder / "runs" / "q" / "ckpt", root)
    code, out, err = cli(capsys, "checkpoint", "ls", str(root), "--verify")
    assert code == 0 and out.count("complete, verified") == 2, out + err
    shard = root / "step_00000020" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    code, out, err = cli(capsys, "checkpoint", "ls", str(root), "--verify")
    assert code == 1 and "DAMAGED" in out, out + err
    code, out, _ = cli(capsys, "checkpoint", "ls", str(root), "--verify", "--json")
    assert code == 1 and [r["damaged"] for r in json.loads(out)] == [False, True]
    code, out, _ = cli(capsys, "checkpoint", "ls", str(root))  # without --verify: sizes only, as before
    assert code == 0


def test_a_run_folder_resumes_training(in_run_folder, tmp_path):
    """--resume_from RUN_DIR: the run's newest complete checkpoint, as export and ls take it."""
    from torchrec_cloud.checkpoint.store import resolve

    assert Path(resolve("runs/q").path).name == "step_00000020"
    assert Path(resolve("runs/q/ckpt").path).name == "step_00000020"
