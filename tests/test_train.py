"""Training end to end: learning is real, ranks agree, the seed commands run."""

import os
import re

import pytest
import torch

from helpers import PYTHON, REPO, TINY, evals, explain, read_metrics, run, torchrun

LEARN = [
    "--num_embeddings", "100",
    "--embedding_dim", "8",
    "--dense_arch_layer_sizes", "32,8",
    "--over_arch_layer_sizes", "32,1",
    "--batch_size", "1024",
    "--num_batches_per_epoch", "300",
    "--num_eval_batches", "16",
    "--learning_rate", "0.1",
    "--eval_every", "150",
    "--no-progress",
]  # fmt: skip


def test_one_process_learns_the_planted_signal(tmp_path):
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--synthetic", "planted", *LEARN, "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path)
    start = records[0]
    assert start["event"] == "start" and start["world_size"] == 1
    assert start["config"]["model"]["embedding_dim"] == 8
    bayes = start["bayes_auc"]
    val = evals(records, "val")
    assert [r["step"] for r in val] == [150, 300]
    assert val[-1]["auc"] > val[0]["auc"] - 0.005  # still improving or flat, not diverging
    assert bayes - val[-1]["auc"] < 0.02, (bayes, val[-1])
    test = evals(records, "test")
    assert len(test) == 1 and test[0]["auc"] > 0.75
    for r in records[1:]:
        if r["event"] in ("train", "eval"):
            for key in ("step", "split", "loss", "auc", "logloss", "samples_per_s", "world_size"):
                assert key in r, (key, r)
    train = [r for r in records if r["event"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(r["samples_per_s"] > 0 for r in train)
    # The sharding plan is printed on rank 0, and the fused optimizer was used.
    assert "sharding plan" in proc.stdout and "fused" in proc.stdout
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_learns_the_planted_signal(tmp_path):
    # NCCL, tables in HBM, the dense part moved to the GPU without DDP in a world of one.
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--synthetic", "planted", *LEARN, "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path)
    assert records[0]["device"] == "cuda" and records[0]["backend"] == "nccl"
    assert records[0]["bayes_auc"] - evals(records, "val")[-1]["auc"] < 0.02
    assert evals(records, "test")[0]["auc"] > 0.75


def test_bf16_training_learns_the_planted_signal(tmp_path):
    # --precision bf16: the MLPs in bfloat16 autocast, tables and optimizer state float32.
    args = [PYTHON, "-m", "torchrec_cloud", "train", "--synthetic", "planted", *LEARN, "--precision", "bf16",
            "--no-tensorboard", "--output_dir", str(tmp_path)]  # fmt: skip
    proc = run(args)
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path)
    assert records[0]["config"]["train"]["precision"] == "bf16"
    assert records[0]["bayes_auc"] - evals(records, "val")[-1]["auc"] < 0.03
    assert evals(records, "test")[0]["auc"] > 0.75
    # The same short run in fp32 and bf16: close, but not the same arithmetic.
    losses = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        proc = run([PYTHON, "-m", "torchrec_cloud", "train", *TINY, "--log_every", "5", "--precision", precision,
                    "--no-tensorboard", "--output_dir", str(out)])  # fmt: skip
        assert proc.returncode == 0, explain(proc)
        losses[precision] = [r["loss"] for r in read_metrics(out) if r["event"] == "train"]
    assert losses["fp32"] != losses["bf16"]
    assert losses["fp32"] == pytest.approx(losses["bf16"], rel=0.05)
    bad = run([PYTHON, "-m", "torchrec_cloud", "train", "--precision", "fp16"])
    assert bad.returncode == 2 and "--precision" in bad.stderr, explain(bad)


def test_random_labels_cannot_be_learned(tmp_path):
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--synthetic", "random", *TINY, "--output_dir", str(tmp_path)])
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path)
    assert "bayes_auc" not in records[0]
    assert abs(evals(records, "test")[0]["auc"] - 0.5) < 0.06


def test_two_ranks_through_torchrun_agree_and_spread_tables(tmp_path, capsys):
    out = tmp_path / "run"
    proc = torchrun(2, ["-m", "torchrec_cloud", "train", *TINY, "--output_dir", str(out)])
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(out)
    assert records[0]["world_size"] == 2
    # Each rank computes the metrics over the whole gathered split; rank 0 logs them and
    # every rank prints them: the printed lines must match across ranks.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[test]")]
    assert len(lines) == 1  # only rank 0 prints
    val = evals(records, "val")[-1]
    assert val["rows"] == 4 * 256  # the whole split, not one rank's half
    # The plan puts tables on both ranks: a line per placement, tables of one placement grouped.
    plan_lines = [line for line in proc.stdout.splitlines() if line.startswith("  t_cat_")]
    ranks, tables = set(), 0
    for line in plan_lines:
        ranks |= set(int(r) for r in line.rsplit("ranks ", 1)[1].split(","))
        tables += int(re.search(r"\((\d+) tables\)", line).group(1)) if "tables)" in line else 1
        assert " fused " in line, line
    assert 1 < len(plan_lines) < 26 and tables == 26 and ranks == {0, 1}, proc.stdout
    # `torchrec-cloud plan` for this machine's topology (2 CPU ranks, its host memory) plans
    # what the trainer trained with, as its start record lists it.
    import json

    from torchrec_cloud.cli import main
    from torchrec_cloud.distributed import _host_memory_bytes

    host_gib = str(_host_memory_bytes() / 2**30)
    assert main(["plan", *TINY, "--gpus_per_node", "0", "--procs_per_node", "2", "--host_memory", host_gib,
                 "--json"]) == 0  # fmt: skip
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert planned["tables"] == records[0]["plan"]


def test_ranks_with_unequal_batch_counts_stop_together(tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(
        "import sys\n"
        "from torchrec_cloud.config import parse_job_config\n"
        "from torchrec_cloud.data.synthetic import SyntheticSource\n"
        "from torchrec_cloud.train import run\n"
        "import torch.distributed as dist, os\n"
        "class Uneven(SyntheticSource):\n"
        "    def train_batches(self, epoch, start_batch=0):\n"
        "        n = 7 if self.rank == 1 else 10  # rank 1 runs short\n"
        "        for i, b in enumerate(super().train_batches(epoch, start_batch)):\n"
        "            if i >= n: return\n"
        "            yield b\n"
        "cfg = parse_job_config(sys.argv[1:])\n"
        "rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
        "result = run(cfg, source=Uneven(cfg, rank, world))\n"
        "sys.stdout.write(f'steps {rank} {result[\"step\"]}\\n')  # one write: the ranks share stdout\n"
        "dist.barrier(); dist.destroy_process_group()\n"
    )
    proc = torchrun(2, [str(script), *TINY, "--output_dir", str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "steps 0 7" in proc.stdout and "steps 1 7" in proc.stdout, proc.stdout


SEED_FLAGS = ["--num_batches_per_epoch", "3", "--num_eval_batches", "2", "--no-progress"]


def test_seed_quickstart_command_runs_from_its_folder(tmp_path):
    # `python train_torchrec_quickstart.py --batch_size 4096 --embedding_dim 256 --num_epochs 10
    # --learning_rate 0.5` as the seed writes it, cut to a few steps and small tables to keep
    # the suite fast (the bottom MLP's last layer follows --embedding_dim).
    proc = run(
        [PYTHON, "train_torchrec_quickstart.py", "--batch_size", "4096", "--embedding_dim", "256",
         "--num_epochs", "2", "--learning_rate", "0.5",
         "--num_embeddings", "2000", *SEED_FLAGS, "--output_dir", str(tmp_path)],
        cwd=REPO / "quickstart",
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path)
    cfg = records[0]["config"]
    assert cfg["preset"] == "quickstart"
    assert cfg["data"]["batch_size"] == 4096 and cfg["model"]["embedding_dim"] == 256
    assert cfg["model"]["dense_arch_layer_sizes"] == [512, 256, 256]
    assert cfg["optimizer"]["learning_rate"] == 0.5 and cfg["train"]["num_epochs"] == 2
    assert [r["step"] for r in evals(records, "test")] == [6]


def test_seed_quickstart_under_torchrun_with_four_ranks(tmp_path):
    proc = torchrun(
        4,
        ["train_torchrec_quickstart.py", "--num_embeddings", "2000", "--batch_size", "512", *SEED_FLAGS,
         "--output_dir", str(tmp_path)],
        cwd=REPO / "quickstart",
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(tmp_path)
    assert records[0]["world_size"] == 4
    assert evals(records, "test")
    cores = len(os.sched_getaffinity(0))
    warned = [line for line in proc.stderr.splitlines() if "ranks on this host share" in line]
    assert len(warned) == (1 if cores < 4 else 0), proc.stderr  # once per host, where it applies
    if warned:
        assert f"--nproc_per_node={cores}" in warned[0]


def test_seed_train_dlrm_accepts_the_criteo_flags(tmp_path):
    sizes = "4000,3906,1729,742,2026,3,712,154,63,4000,3067,4052,10,2209,1193,155,4,976,14,4000,4000,4000,5901,1297,108,36"
    proc = run(
        [PYTHON, "train_dlrm.py", "--num_embeddings_per_feature", sizes, "--embedding_dim", "16",
         "--dense_arch_layer_sizes", "64,32,16", "--over_arch_layer_sizes", "64,32,1",
         "--batch_size", "256", "--learning_rate", "1.0", *SEED_FLAGS, "--output_dir", str(tmp_path)],
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    cfg = read_metrics(tmp_path)[0]["config"]
    assert cfg["preset"] == "criteo-1tb"
    assert cfg["model"]["num_embeddings_per_feature"][0] == 4000
