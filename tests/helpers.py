"""Shared by the tests: a tiny model config, running the CLI, reading metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torchrec_cloud.ports import free_port  # noqa: F401  (the tests' free ports, one rule)

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]

# Small enough to train in seconds on 2 cores, big enough to learn the planted signal.
TINY = [
    "--num_embeddings", "100",
    "--embedding_dim", "8",
    "--dense_arch_layer_sizes", "32,8",
    "--over_arch_layer_sizes", "32,1",
    "--batch_size", "256",
    "--num_batches_per_epoch", "10",
    "--num_eval_batches", "4",
    "--no-progress",
]  # fmt: skip


def shm_usable(ranks: int = 2) -> bool:
    """Whether ranks on this machine move their collectives through /dev/shm (shm_group.py)."""
    from torchrec_cloud.speedups import shm_group

    return shm_group.host_reason(ranks) is None


def with_speedups(model, device: str = "cpu"):
    """A built model with the speed-ups layer's arches and layers, as a run on ``device`` has it."""
    import torch

    from torchrec_cloud.speedups import Speedups

    Speedups.for_model(torch.device(device)).apply_to_model(model)
    return model


def env_for_subprocess() -> dict[str, str]:
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(args: list[str], cwd: Path | str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command, capture its output; never raises on a non-zero exit."""
    return subprocess.run(
        args, cwd=cwd, env=env_for_subprocess(), capture_output=True, text=True, timeout=timeout
    )


def torchrun(nproc: int, args: list[str], cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real launcher on one host, standalone rendezvous on a free loopback port."""
    launcher = TORCHRUN + [
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--nnodes=1",
    ]
    return run(launcher + args, cwd=cwd, timeout=timeout)


def read_metrics(output_dir: Path | str) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evals(records: list[dict], split: str) -> list[dict]:
    return [r for r in records if r.get("event") == "eval" and r.get("split") == split]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``torchrec-cloud ARGV`` in this process: (exit code, stdout, stderr)."""
    from torchrec_cloud.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(capsys, code: int, *argv: str) -> str:
    """The one line a refused command prints: exit ``code``, no traceback."""
    rc, out, err = cli(capsys, *argv)
    assert rc == code and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]
