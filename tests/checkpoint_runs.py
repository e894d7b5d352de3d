"""Launching tiny training runs for the checkpoint tests: one process, or torchrun.

Every run uses the same tiny model (seconds per run on 2 cores) and writes
``<out>/metrics.jsonl``; :func:`metrics` reads it back. Multi-rank runs go through the real
launcher (``python -m torch.distributed.run``) on a free port of 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from helpers import TORCHRUN, env_for_subprocess
from services import free_port

TINY = [
    "--num_embeddings", "1000", "--embedding_dim", "16",
    "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1",
    "--batch_size", "256", "--num_batches_per_epoch", "20", "--num_eval_batches", "4",
    "--no-progress", "--no-tensorboard",
]  # fmt: skip


def env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    return {**env_for_subprocess(), **(extra or {})}


LAUNCH = [sys.executable, "-m", "torchrec_cloud", "launch"]


def train_cmd(nproc: int, out: Path, *flags: str, max_restarts: int = 0, launcher: list[str] = TORCHRUN) -> list[str]:
    """``torchrec-cloud train`` with the tiny model: plain python for 1, ``launcher`` (torchrun,
    or ``LAUNCH``, torchrec-cloud's) for more."""
    args = ["-m", "torchrec_cloud", "train", *TINY, "--output_dir", str(out), *flags]
    if nproc == 1:
        return [sys.executable, *args]
    return [
        *launcher, f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        f"--max_restarts={max_restarts}", "--monitor_interval=0.5", *args,
    ]  # fmt: skip


def run(cmd: list[str], timeout: float = 300, extra_env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, env=env(extra_env), capture_output=True, text=True, timeout=timeout)
    return result


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def start(cmd: list[str], extra_env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now
    return records


def last(records: list[dict], **match) -> dict:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    assert found, f"no record with {match} in {[r.get('event') for r in records]}"
    return found[-1]


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def children(pid: int) -> list[int]:
    """Direct child process ids of ``pid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append(int(entry.name))
    return out


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Damage a file as a bad disk or a botched copy would: bytes in its middle inverted, its
    size unchanged (a size check cannot see it)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))
