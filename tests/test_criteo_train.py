"""Training on preprocessed Criteo TSV: the model learns a planted signal, and two ranks
under torchrun read shards from a storage emulator, scoring every held-out row once."""

from __future__ import annotations

import json

import os
import subprocess
import sys
from pathlib import Path

from torchrec_cloud import storage
from torchrec_cloud.cli import main
from torchrec_cloud.ports import free_port
from torchrec_cloud.data.criteo_gen import write_criteo_tsv

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    port = free_port()
    return run([PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", *args])


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]


def evals(records: list[dict], split: str) -> list[dict]:
    return [r for r in records if r.get("event") == "eval" and r.get("split") == split]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


MODEL = [
    "--num_embeddings", "1000",
    "--embedding_dim", "8",
    "--dense_arch_layer_sizes", "32,8",
    "--over_arch_layer_sizes", "32,1",
    "--learning_rate", "0.03",
    "--no-progress",
    "--no-tensorboard",
]  # fmt: skip


def _preprocess(tsv, out, *extra) -> None:
    rc = main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(tsv),
               "--output", str(out), "--num_embeddings", "1000", *extra])
    assert rc == 0


def test_training_on_preprocessed_tsv_learns(tmp_path):
    tsv = tmp_path / "train.txt"
    info = write_criteo_tsv(str(tsv), rows=14_000, seed=0, vocab=60)
    _preprocess(tsv, tmp_path / "data")
    # One dataset format: Criteo is the built-in schema (the contract other checks rely on).
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["format"] == "torchrec-cloud-shards" and manifest["schema"]["name"] == "criteo"
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(tmp_path / "data"),
                *MODEL, "--batch_size", "200", "--num_epochs", "2", "--shuffle",
                "--output_dir", str(tmp_path / "run")])
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path / "run")
    test = evals(records, "test")[-1]
    assert test["rows"] == 1000  # 14000 // 7 held out, the second half is test
    # The teacher's own AUC on this data is about 0.95; a model that learned nothing, 0.5.
    assert info["bayes_auc"] > 0.9
    assert test["auc"] > 0.8, test
    train = [r for r in records if r.get("event") == "train"]
    assert train[-1]["loss"] < train[0]["loss"]


def test_two_ranks_read_shards_from_s3_emulator(tmp_path, s3_service, monkeypatch):
    for key, value in s3_service.env.items():
        monkeypatch.setenv(key, value)
    tsv = tmp_path / "train.txt"
    write_criteo_tsv(str(tsv), rows=3003, seed=1)
    url = f"{s3_service.url}/criteo-kaggle"
    _preprocess(tsv, url, "--chunk_mb", "0.1", "--workers", "2")
    out = tmp_path / "run"
    proc = torchrun(2, ["-m", "torchrec_cloud", "train", "--dataset_path", url, *MODEL,
                        "--batch_size", "128", "--num_epochs", "1", "--output_dir", str(out)])
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(out)
    assert records[0]["world_size"] == 2
    manifest = json.loads(storage.read_bytes(url + "/manifest.json"))
    val_rows = sum(e - s for _, s, e in manifest["splits"]["val"])
    assert val_rows == 215  # 3003 // 7 = 429 held out: 215 val (odd over 2 ranks), 214 test
    assert evals(records, "val")[-1]["rows"] == val_rows
    assert evals(records, "test")[-1]["rows"] == 214
    end = [r for r in records if r.get("event") == "end"][0]
    assert end["step"] == (3003 - 429) // (2 * 128)
