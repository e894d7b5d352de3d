"""After training: export a 2-rank checkpoint on one process, score with the exported module
(``predict``, and a fresh Python with torch alone), quantize, and refuse bad inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PYTHON, evals, explain, read_metrics, torchrun
from torchrec_cloud.cli import main
from torchrec_cloud.data.criteo_gen import write_criteo_tsv

MODEL = [
    "--num_embeddings", "1000", "--embedding_dim", "8",
    "--dense_arch_layer_sizes", "32,8", "--over_arch_layer_sizes", "32,1",
    "--learning_rate", "0.03", "--batch_size", "200", "--no-progress", "--no-tensorboard",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-rank run on preprocessed Criteo TSV with checkpoints, and its last one exported."""
    root = tmp_path_factory.mktemp("serving")
    write_criteo_tsv(str(root / "train.txt"), rows=7_000, seed=0, vocab=60)
    assert main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(root / "train.txt"),
                 "--output", str(root / "data"), "--num_embeddings", "1000"]) == 0  # fmt: skip
    proc = torchrun(2, ["-m", "torchrec_cloud", "train", "--dataset_path", str(root / "data"), *MODEL,
                        "--output_dir", str(root / "run"), "--checkpoint_path", str(root / "ck")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    assert main(["export", str(root / "ck"), "--output", str(root / "model")]) == 0
    return root


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_predict_on_val_gives_the_runs_final_evaluation(run, capsys):
    val = evals(read_metrics(run / "run"), "val")[-1]
    rc, out, err = cli(capsys, "predict", str(run / "model"), "--dataset_path", str(run / "data"),
                       "--split", "val", "--output", str(run / "val.csv"), "--no_progress")  # fmt: skip
    assert rc == 0, err
    last = out.strip().splitlines()[-1]
    assert "auc" in last and f"rows {val['rows']}" in last, out
    rc, out, err = cli(capsys, "predict", str(run / "model"), "--dataset_path", str(run / "data"),
                       "--split", "val", "--output", str(run / "val.csv"), "--json", "--batch_size", "333")  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)
    assert result["rows"] == val["rows"] == 500  # 7000 // 7 held out, half of it val
    assert result["auc"] == pytest.approx(val["auc"], abs=1e-5)
    assert result["logloss"] == pytest.approx(val["logloss"], rel=1e-5)
    rc, out, err = cli(capsys, "predict", str(run / "model"), "--dataset_path", str(run / "data"),
                       "--split", "all", "--output", str(run / "all.csv"), "--json", "--no_progress")  # fmt: skip
    assert rc == 0 and json.loads(out)["rows"] == 7_000, err  # every row, train's included
    lines = (run / "val.csv").read_text().splitlines()
    assert lines[0] == "probability,label" and len(lines) == 1 + val["rows"]
    probabilities = [float(line.split(",")[0]) for line in lines[1:]]
    assert all(0 < p < 1 for p in probabilities) and len(set(probabilities)) > 100


FRESH = r"""
import sys
class NoTorchRec:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "torchrec_cloud", "fbgemm_gpu"):
            raise ImportError("this process must not import " + name)
sys.meta_path.insert(0, NoTorchRec())
import torch
scorer = torch.jit.load(sys.argv[1])
inputs = torch.load(sys.argv[2])
torch.save(scorer(inputs["dense"], inputs["ids"]), sys.argv[3])
"""


def test_exported_module_scores_in_a_python_with_torch_alone(run, tmp_path, capsys):
    from torchrec_cloud.data.reader import criteo_source

    source = criteo_source(str(run / "data"), batch_size=50, rank=0, world_size=1, table_sizes=[1000] * 26)
    batch, valid = next(source.eval_batches("val"))
    ids = batch.sparse_features.values().view(26, 50).t()
    torch.save({"dense": batch.dense_features, "ids": ids}, tmp_path / "inputs.pt")
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([PYTHON, "-c", FRESH, str(run / "model" / "scorer.pt"), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = torch.load(tmp_path / "out.pt")
    csv = run / "first.csv"
    assert main(["predict", str(run / "model"), "--dataset_path", str(run / "data"), "--output", str(csv),
                 "--no_progress"]) == 0  # fmt: skip
    expected = torch.tensor([float(line.split(",")[0]) for line in csv.read_text().splitlines()[1 : 1 + valid]])
    torch.testing.assert_close(scored.float(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("quantize", ["fp16", "int8"])
def test_quantized_tables_shrink_the_module_and_cost_little_auc(run, capsys, quantize):
    out_dir = run / f"model_{quantize}"
    rc, out, err = cli(capsys, "export", str(run / "ck"), "--output", str(out_dir), "--quantize", quantize)
    assert rc == 0, err
    assert f"quantize {quantize}:" in out and "val AUC" in out, out  # the cost, printed
    config = json.loads((out_dir / "model_config.json").read_text())
    q = config["quantization"]
    assert q["rows"] == 500
    assert abs(q["auc_change"]) < 0.005, q  # the tolerance docs/serving.md states
    full, small = config["scorer_bytes_fp32"], (out_dir / "scorer.pt").stat().st_size
    assert small == config["files"]["scorer.pt"]
    # fp16: 2 bytes a value; int8: 1, plus 4 a row (dim 8 here: 12 bytes a row against 32).
    assert small < full * (0.6 if quantize == "fp16" else 0.45), (full, small)
    rc, out, err = cli(capsys, "predict", str(out_dir), "--dataset_path", str(run / "data"),
                       "--output", str(run / f"{quantize}.csv"), "--json")  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["auc"] == pytest.approx(q["auc"], abs=1e-6)


def one_line_error(capsys, *argv: str) -> str:
    rc, out, err = cli(capsys, *argv)
    assert rc != 0 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_bad_inputs_get_one_line_and_a_nonzero_exit(run, tmp_path, capsys):
    step = next((run / "ck").glob("step_*"))
    # A truncated shard file: the commit's sizes catch it.
    truncated = tmp_path / "truncated" / step.name
    shutil.copytree(step, truncated)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    line = one_line_error(capsys, "export", str(truncated), "--output", str(tmp_path / "m1"))
    assert "truncated" in line and shard.name in line, line
    # An unfinished save (no commit).
    (truncated / "COMMIT.json").unlink()
    line = one_line_error(capsys, "export", str(truncated), "--output", str(tmp_path / "m1"))
    assert "COMMIT.json" in line, line
    # A damaged index (same size, other bytes): the reader fails, named.
    damaged = tmp_path / "damaged" / step.name
    shutil.copytree(step, damaged)
    index = damaged / ".metadata"
    index.write_bytes(b"\0" * index.stat().st_size)
    line = one_line_error(capsys, "export", str(damaged), "--output", str(tmp_path / "m2"))
    assert "cannot read checkpoint" in line, line
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
    # A model directory from another version.
    other = tmp_path / "other_version"
    shutil.copytree(run / "model", other)
    config = json.loads((other / "model_config.json").read_text())
    (other / "model_config.json").write_text(json.dumps({**config, "version": 99}))
    line = one_line_error(capsys, "predict", str(other), "--dataset_path", str(run / "data"), "--output", str(tmp_path / "o.csv"))
    assert "v99" in line, line
    # A dataset preprocessed for bigger tables than the model has.
    bigger = tmp_path / "bigger"
    shutil.copytree(run / "data", bigger)
    manifest = json.loads((bigger / "manifest.json").read_text())
    manifest["transforms"]["table_sizes"] = [5000] * 26
    (bigger / "manifest.json").write_text(json.dumps(manifest))
    line = one_line_error(capsys, "predict", str(run / "model"), "--dataset_path", str(bigger), "--output", str(tmp_path / "o.csv"))
    assert "does not fit the model" in line and "4999" in line, line
    assert not (tmp_path / "o.csv").exists()
    # A Criteo dataset written by an older version (its own manifest format): the command that rewrites it.
    older = tmp_path / "older"
    shutil.copytree(run / "data", older)
    manifest = json.loads((older / "manifest.json").read_text())
    (older / "manifest.json").write_text(json.dumps({"format": "torchrec-cloud-criteo-shards", "version": 1,
                                                     "dataset": "kaggle", "sources": manifest["sources"]}))
    line = one_line_error(capsys, "predict", str(run / "model"), "--dataset_path", str(older), "--output", str(tmp_path / "o.csv"))
    assert "older version" in line and "torchrec-cloud data preprocess --format kaggle --input" in line, line
    assert not (tmp_path / "o.csv").exists()


def test_a_raw_tsv_scores_as_the_shards_made_of_it(run, capsys, tmp_path):
    """The preprocessed file itself, plain and gzipped: the same rows as every split of its
    shards, so the same AUC and log loss; a malformed line is one line naming FILE:LINE."""
    import gzip

    def predict(dataset: Path, split: str = "all") -> tuple[int, str, str]:
        return cli(capsys, "predict", str(run / "model"), "--dataset_path", str(dataset), "--split", split,
                   "--output", str(tmp_path / "scores.csv"), "--json", "--no_progress", "--batch_size", "999")  # fmt: skip

    rc, out, err = predict(run / "data")
    assert rc == 0, err
    shards = json.loads(out)
    gz = tmp_path / "train.txt.gz"
    gz.write_bytes(gzip.compress((run / "train.txt").read_bytes()))
    for raw in (run / "train.txt", gz):
        rc, out, err = predict(raw)
        assert rc == 0, err
        result = json.loads(out)
        assert (result["rows"], result["split"]) == (7_000, "file")
        assert result["auc"] == pytest.approx(shards["auc"], abs=1e-9)
        assert result["logloss"] == pytest.approx(shards["logloss"], rel=1e-9)
    lines = (run / "train.txt").read_text().splitlines(keepends=True)
    lines[49] = "1\tnot-a-number" + lines[49][lines[49].index("\t", 2) :]
    bad = tmp_path / "bad.txt"
    bad.write_text("".join(lines[:100]))
    rc, out, err = predict(bad)
    assert rc == 1 and f"{bad}:50: " in err and len(err.strip().splitlines()) == 1, err


def test_predict_input_takes_a_raw_criteo_tsv(run, capsys, tmp_path):
    """``predict --input FILE`` (the own-data spelling) scores a raw Criteo TSV as ``--dataset_path FILE`` does."""
    outs = []
    for flag in ("--input", "--dataset_path"):
        rc, out, err = cli(capsys, "predict", str(run / "model"), flag, str(run / "train.txt"), "--output",
                           str(tmp_path / "s.csv"), "--json", "--no_progress", "--batch_size", "999")  # fmt: skip
        assert rc == 0, err
        outs.append(json.loads(out))
    assert outs[0]["rows"] == outs[1]["rows"] == 7_000 and outs[0]["auc"] == outs[1]["auc"]
    line = one_line_error(capsys, "predict", str(run / "model"), "--output", str(tmp_path / "s.csv"))
    assert "--input" in line and "--dataset_path" in line, line
