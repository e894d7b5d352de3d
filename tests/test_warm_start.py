"""Warm starts (issue #42): ``train --warm_start CKPT`` loads a complete checkpoint's model and
optimizer state into a new run, on any rank count, resets the rows its dataset's vocabulary
reused, and refuses a dataset of another lineage or a checkpoint of another model in one line.

The datasets are real days of a lineage (``data preprocess --vocab_from``): a child of the
checkpoint's vocabulary whose full user table reused the rows of users it did not see, and
the same day preprocessed on its own (another lineage). Runs use a
learning rate too small to move a float32 weight where a test compares tensors: a row the run does not train keeps exactly what
was loaded, and which rows a run trains depends only on the data, not on the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import explain, one_line_error, read_metrics, torchrun
from torchrec_cloud.checkpoint import load_full_state
from torchrec_cloud.cli import main
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.dataset import load_dataset
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, write_events
from torchrec_cloud.train import run as train

MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
         "--batch_size", "100", "--no-progress", "--no-tensorboard", "--eval_every", "0", "--num_epochs", "1"]  # fmt: skip
FROZEN = ["--learning_rate", "1e-30"]  # too small to move a float32 weight: what was loaded stays
USER = "model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"
MOMENTUM = f"optimizer.state.{USER[len('model.'):]}.t_user.momentum1"
DENSE_STEP = "optimizer.state.model.over_arch.model.1.bias.step"


def newest(folder: Path) -> Path:
    return sorted(folder.glob("step_*"))[-1]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}

    def walk(node, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(load_full_state(str(newest(folder))), "")
    return flat


def with_vocabulary(source: Path, target: Path, section: dict) -> Path:
    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["vocabulary"] = section
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def train_1(*flags: str) -> dict:
    return train(parse_job_config([*MODEL, *flags]))


# The events' schema with a user table that fills: the next day evicts the users it did not
# see (evict_after: 1) and gives their rows to new ones.
GROWING = SCHEMA.replace("{name: user, type: string, mapping: vocab, num_embeddings: 1000}",
                         "{name: user, type: string, mapping: vocab, num_embeddings: 100, evict_after: 1}")


def preprocess(root: Path, name: str, seed: int, vocab_from: str | None = None) -> dict:
    write_events(str(root / f"events_{name}"), days=4, rows_per_day=300, seed=seed)
    argv = ["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
            str(root / f"events_{name}"), "--output", str(root / name), "--split_by", "ts",
            "--val_from", str(START + 2 * DAY_S), "--test_from", str(START + 3 * DAY_S)]  # fmt: skip
    assert main(argv + (["--vocab_from", str(root / vocab_from)] if vocab_from else [])) == 0
    return json.loads((root / name / "manifest.json").read_text())["vocabulary"]


@pytest.fixture(scope="module")
def lineage(tmp_path_factory):
    """``data`` (one day's preprocessing), a 1-rank parent checkpoint ``parent`` trained on
    it, a frozen warm start from it on the same data (``same``); ``grown``: the next day
    preprocessed with --vocab_from ``data`` (its full user table reuses the rows of users it
    did not see), and ``stranger``: that day preprocessed on its own (another lineage)."""
    root = tmp_path_factory.mktemp("warm")
    (root / "schema.yaml").write_text(GROWING)
    digest = preprocess(root, "data", 3)["digest"]
    train_1("--dataset_path", str(root / "data"), "--checkpoint_path", str(root / "parent"),
            "--output_dir", str(root / "parent_run"))  # fmt: skip
    # A frozen warm start on the parent's own data: nothing reset, everything as loaded but
    # the row-wise state of the rows this data trains.
    train_1("--dataset_path", str(root / "data"), "--warm_start", str(root / "parent"), *FROZEN,
            "--checkpoint_path", str(root / "same"), "--output_dir", str(root / "same_run"))  # fmt: skip
    parent, same = tensors(root / "parent"), tensors(root / "same")
    grown = preprocess(root, "grown", 4, vocab_from="data")
    preprocess(root, "stranger", 4)
    reused = grown["reset_rows"]["user"]
    assert reused and grown["ancestors"] == [digest], grown
    assert bool(parent[MOMENTUM][reused].gt(0).any()), "some reused rows held the parent's trained state"
    return {"root": root, "parent": parent, "same": same, "reused": reused, "digest": digest, "grown": grown}


def test_a_warm_start_on_the_same_vocabulary_loads_everything(lineage):
    parent, same = lineage["parent"], lineage["same"]
    assert torch.equal(same[USER], parent[USER]), "the tables as saved (nothing trains at rate 0)"
    steps = read_metrics(lineage["root"] / "same_run")
    trained = [r for r in steps if r["event"] == "end"][0]["step"]
    assert int(same[DENSE_STEP]) == int(parent[DENSE_STEP]) + trained, "the dense optimizer's state goes on"
    start = steps[0]
    assert start["parent"]["path"] == str(newest(lineage["root"] / "parent"))
    assert start["parent"]["vocabulary_digest"] == lineage["digest"]


@pytest.fixture(scope="module")
def two_ranks(lineage):
    """A frozen warm start on 2 ranks (torchrun, gloo) from the 1-rank parent, on ``grown``."""
    root = lineage["root"]
    result = torchrun(2, ["-m", "torchrec_cloud", "train", *MODEL, *FROZEN, "--dataset_path", str(root / "grown"),
                          "--warm_start", str(root / "parent"), "--checkpoint_path", str(root / "two"),
                          "--output_dir", str(root / "two_run")])  # fmt: skip
    assert result.returncode == 0, explain(result)
    return tensors(root / "two")


def test_two_ranks_warm_start_from_one_rank_and_reset_the_reused_rows(lineage, two_ranks):
    parent, reused = lineage["parent"], lineage["reused"]
    kept = [r for r in range(parent[USER].shape[0]) if r not in reused]
    assert torch.equal(two_ranks[USER][kept], parent[USER][kept]), "every other row as the parent left it"
    fresh = two_ranks[USER][reused]
    bound = (1 / parent[USER].shape[0]) ** 0.5  # a fresh table's init range (EmbeddingBagConfig)
    assert not torch.equal(fresh, parent[USER][reused]) and bool((fresh.abs() <= bound).all())
    # Loaded, then only grown (a cold start's state would hold this short run's alone).
    assert bool((two_ranks[MOMENTUM][kept] >= parent[MOMENTUM][kept]).all())
    start = read_metrics(lineage["root"] / "two_run")[0]
    assert start["world_size"] == 2 and start["vocabulary"] == {"version": 1, "digest": lineage["grown"]["digest"]}
    warm = [r for r in read_metrics(lineage["root"] / "two_run") if r["event"] == "warm_start"][0]
    assert warm["saved_world_size"] == 1 and warm["reset_rows"] == {"user": len(reused)}


def test_one_rank_warm_starts_from_two_ranks_and_a_restart_resumes(lineage, two_ranks, tmp_path):
    """The reverse, training: loss from the first logged step, the untrained rows as the
    2-rank checkpoint holds them; the same command again resumes its own checkpoint."""
    root = lineage["root"]
    flags = ["--dataset_path", str(root / "grown"), "--warm_start", str(root / "two"), "--log_every", "1",
             "--checkpoint_path", str(tmp_path / "ck"), "--output_dir", str(tmp_path / "run")]  # fmt: skip
    train_1(*flags)
    records = read_metrics(tmp_path / "run")
    first = [r for r in records if r["event"] == "train"][0]
    assert first["step"] == 1 and first["loss"] > 0
    assert records[0]["parent"]["step"] == int(newest(root / "two").name.split("_")[1])
    got = tensors(tmp_path / "ck")
    assert bool((got[MOMENTUM] >= two_ranks[MOMENTUM]).all()), "the row-wise state loaded, then grown"
    end = [r for r in records if r["event"] == "end"][0]
    assert int(got[DENSE_STEP]) == int(two_ranks[DENSE_STEP]) + end["step"], "the optimizer's state goes on"
    train_1(*flags[:-1], str(tmp_path / "again"))
    again = read_metrics(tmp_path / "again")
    assert any(r["event"] == "resume" for r in again) and not any(r["event"] == "warm_start" for r in again)
    assert "parent" not in again[0]


def test_the_reused_rows_load_fresh_with_no_optimizer_state(lineage):
    """What the warm start leaves in the model before its first step (1 rank, in this process):
    the parent's tables and row-wise state but for the reused rows, which hold fresh weights
    and no state, and this run's learning rate, not the saved one."""
    from torchrec_cloud.build import build
    from torchrec_cloud.checkpoint import Checkpointer, training_state
    from torchrec_cloud.data import with_dataset_features
    from torchrec_cloud.distributed import init_distributed
    from torchrec_cloud.train import _vocabulary

    root, parent, reused = lineage["root"], lineage["parent"], lineage["reused"]
    cfg = with_dataset_features(parse_job_config([*MODEL, "--learning_rate", "0.5", "--dataset_path", str(root / "grown"),
                                                  "--warm_start", str(root / "parent")]))  # fmt: skip
    env = init_distributed(cfg.train.backend, cfg.train.num_threads, cfg.train.pg_timeout_s)
    checkpoints = Checkpointer(cfg, env, None, vocabulary=_vocabulary(load_dataset(str(root / "grown"))))
    trainer = build(cfg, env)
    checkpoints.load_warm(trainer.dmp, trainer.optimizer, trainer.scheduler, cfg.model, cfg.data.seed)
    state = training_state(trainer.dmp, trainer.optimizer, 0)
    weight = state["model"][USER[len("model."):]].local_shards()[0].tensor
    momentum = state["optimizer"]["state"][USER[len("model."):]]["t_user.momentum1"].local_shards()[0].tensor
    kept = [r for r in range(weight.shape[0]) if r not in reused]
    assert torch.equal(weight[kept], parent[USER][kept]) and torch.equal(momentum[kept], parent[MOMENTUM][kept])
    assert momentum[reused].eq(0).all() and not torch.equal(weight[reused], parent[USER][reused])
    assert all(abs(g["lr"] - 0.5) < 1e-6 for g in trainer.optimizer.param_groups[-1:]), "this run's schedule"


def test_a_dataset_of_another_lineage_is_refused_in_one_line(lineage, capsys, tmp_path):
    root = lineage["root"]
    line = one_line_error(capsys, 2, "train", *MODEL, "--dataset_path", str(root / "stranger"), "--warm_start",
                          str(root / "parent"), "--checkpoint_path", str(tmp_path / "ck"),
                          "--output_dir", str(tmp_path / "run"))  # fmt: skip
    assert "--warm_start" in line and "does not descend" in line and lineage["digest"][:16] in line
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("step_*"))


def test_a_checkpoint_of_another_model_is_refused_in_one_line(lineage, capsys, tmp_path):
    root = lineage["root"]
    line = one_line_error(capsys, 2, "train", *MODEL, "--embedding_dim", "4", "--dense_arch_layer_sizes", "16,4", "--dataset_path", str(root / "grown"),
                          "--warm_start", str(root / "parent"), "--output_dir", str(tmp_path / "run"))  # fmt: skip
    assert "--warm_start" in line and "--embedding_dim 8 (saved) vs 4 (now)" in line


def test_a_damaged_vocabulary_section_is_refused_in_one_line(lineage, capsys, tmp_path):
    root = lineage["root"]
    section = {**lineage["grown"], "reset_rows": {"user": ["../../etc"]}}  # its digest still its vocabularies'
    bad = with_vocabulary(root / "grown", tmp_path / "bad", section)
    line = one_line_error(capsys, 2, "train", *MODEL, "--dataset_path", str(bad), "--warm_start", str(root / "parent"),
                          "--output_dir", str(tmp_path / "run"))  # fmt: skip
    assert "manifest.json" in line and "vocabulary.reset_rows.user[0]" in line and "damaged or altered" in line


def test_data_without_vocabularies_warm_starts_on_equal_tables(tmp_path, capsys):
    """Synthetic data (as Criteo's or a hash-only schema's, no vocabulary): any checkpoint of
    the same model warm-starts, nothing is reset, and its checkpoints record no vocabulary."""
    from helpers import TINY

    train(parse_job_config([*TINY, "--no-tensorboard", "--checkpoint_path", str(tmp_path / "a"),
                            "--output_dir", str(tmp_path / "a_run")]))  # fmt: skip
    train(parse_job_config([*TINY, "--no-tensorboard", "--warm_start", str(tmp_path / "a"), "--checkpoint_path",
                            str(tmp_path / "b"), "--output_dir", str(tmp_path / "b_run")]))  # fmt: skip
    records = read_metrics(tmp_path / "b_run")
    warm = [r for r in records if r["event"] == "warm_start"][0]
    assert warm["reset_rows"] == {} and records[0]["parent"]["vocabulary_digest"] is None
    commit = json.loads((newest(tmp_path / "b") / "COMMIT.json").read_text())
    assert "vocabulary" not in commit and commit["trainer"]["step"] == records[-1]["step"]
    line = one_line_error(capsys, 2, "train", *TINY, "--num_embeddings", "50", "--warm_start", str(tmp_path / "a"),
                          "--output_dir", str(tmp_path / "c_run"))  # fmt: skip
    assert "--warm_start" in line and "different model" in line
