"""A warm start onto a vocabulary that grew (issue #42): the next day's ``data preprocess
--vocab_from`` admits new users into rows after the old ones, so the user table has more rows
than the checkpoint's. The old rows load as saved (weights and row-wise state, on any rank
count), the new ones start as a fresh table's, and a table that shrank is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import explain, one_line_error, torchrun
from torchrec_cloud.checkpoint import load_full_state
from torchrec_cloud.cli import main
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, write_events
from torchrec_cloud.train import run as train

MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
         "--batch_size", "100", "--no-progress", "--no-tensorboard", "--eval_every", "0", "--num_epochs", "1"]  # fmt: skip
FROZEN = ["--learning_rate", "1e-30"]  # too small to move a float32 weight: what was loaded stays
USER = "model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"
MOMENTUM = f"optimizer.state.{USER[len('model.'):]}.t_user.momentum1"


def newest_state(folder) -> dict:
    return load_full_state(str(sorted(folder.glob("step_*"))[-1]))


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """Day 0 (few rows, few users), a 1-rank checkpoint on it, and day 1 (more rows, more
    users) preprocessed with --vocab_from day 0."""
    root = tmp_path_factory.mktemp("grow")
    (root / "schema.yaml").write_text(SCHEMA)
    for day, (rows, seed) in enumerate([(100, 3), (400, 4)]):
        write_events(str(root / f"events{day}"), days=3, rows_per_day=rows, seed=seed)
        argv = ["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
                str(root / f"events{day}"), "--output", str(root / f"d{day}"), "--split_by", "ts",
                "--val_from", str(START + DAY_S), "--test_from", str(START + 2 * DAY_S)]  # fmt: skip
        assert main(argv + (["--vocab_from", str(root / "d0")] if day else [])) == 0
    train(parse_job_config([*MODEL, "--dataset_path", str(root / "d0"), "--checkpoint_path", str(root / "parent"),
                            "--output_dir", str(root / "parent_run")]))  # fmt: skip
    sizes = [json.loads((root / f"d{d}" / "manifest.json").read_text())["transforms"]["table_sizes"][0] for d in (0, 1)]
    assert sizes[0] < sizes[1], f"day 1 admits users day 0 had not seen: {sizes}"
    return {"root": root, "parent": newest_state(root / "parent"), "rows": sizes}


def test_two_ranks_warm_start_a_grown_table_from_one_rank(grown):
    root, parent, (old, new) = grown["root"], grown["parent"], grown["rows"]
    result = torchrun(2, ["-m", "torchrec_cloud", "train", *MODEL, *FROZEN, "--dataset_path", str(root / "d1"),
                          "--warm_start", str(root / "parent"), "--checkpoint_path", str(root / "two"),
                          "--output_dir", str(root / "two_run")])  # fmt: skip
    assert result.returncode == 0, explain(result)
    got = newest_state(root / "two")
    weight, momentum = got[USER], got[MOMENTUM]
    assert weight.shape[0] == new and momentum.shape[0] == new
    assert torch.equal(weight[:old], parent[USER]), "every old user's row as the parent left it"
    assert bool((momentum[:old] >= parent[MOMENTUM]).all()), "their row-wise state loaded, then grown"
    bound = (1 / new) ** 0.5  # a fresh table's init range (EmbeddingBagConfig), not zeros
    assert bool((weight[old:].abs() <= bound).all()) and bool(weight[old:].ne(0).any())


def test_a_table_that_shrank_is_refused_in_one_line(grown, capsys, tmp_path):
    root = grown["root"]
    train(parse_job_config([*MODEL, *FROZEN, "--dataset_path", str(root / "d1"), "--warm_start",
                            str(root / "parent"), "--checkpoint_path", str(tmp_path / "big"),
                            "--output_dir", str(tmp_path / "big_run")]))  # fmt: skip
    line = one_line_error(capsys, 2, "train", *MODEL, "--dataset_path", str(root / "d0"), "--warm_start",
                          str(tmp_path / "big"), "--output_dir", str(tmp_path / "run"))  # fmt: skip
    assert "--warm_start" in line and "num_embeddings_per_feature" in line
