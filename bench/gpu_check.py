"""The GPU paths as a real run takes them, end to end on one machine with a CUDA GPU (issue #33).

Run from the repository root with the CUDA stack installed (``scripts/install.sh`` on a GPU
machine), through ``bench/gpu_check.sh``::

    bash bench/gpu_check.sh              # every check; one line each
    bash bench/gpu_check.sh uvm_prefetch # the named ones

Each check prints one line, ``PASS name: ...``, ``FAIL name: ...`` or, without a GPU,
``NOT RUN name: ...``. Exit code: 0 every check ran and passed, 1 a check failed, 3 none
failed but some could not run here. The CPU tests hold each path's control flow
(tests/test_gpu_paths.py); these are the checks only a GPU can make:

- ``fused`` and ``uvm_prefetch``: ``torchrec-cloud launch`` (torchrun, real c10d rendezvous,
  NCCL) trains the planted data in bf16 with evaluations between segments, tables ``fused``
  or ``fused_uvm_caching`` with ``--prefetch_pipeline``, DataLoader workers (the GPU
  default); SIGTERM to the launcher: exit 200 with a checkpoint; the same command again
  resumes, finishes with exit 0, and learns the signal;
- ``cache_unlocked``: during an evaluation under the prefetch pipeline (16 batches) no UVM
  cache slot stays locked from one batch to the next, and training goes on;
- ``host_lengths``: the input dist copies nothing back from the GPU for our batches (one
  copy per batch without host-side ``length_per_key``);
- ``rng_devices``: a checkpoint saved on 1 GPU resumes on a CPU, and one saved on a CPU
  resumes on the GPU;
- ``pinned``: with ``--data_workers 0`` batches still reach the step pinned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from torchrec_cloud.ports import free_port  # noqa: E402

PYTHON = sys.executable
CHECKS = ("fused", "uvm_prefetch", "cache_unlocked", "host_lengths", "rng_devices", "pinned")
MODEL = [
    "--num_embeddings", "200000", "--embedding_dim", "64", "--batch_size", "8192",
    "--num_eval_batches", "4", "--no-progress", "--no-tensorboard", "--log_every", "10",
]  # fmt: skip


class CheckFailed(Exception):
    pass


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", **extra}  # fmt: skip
    return env


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # being written
    return records


def _launch(out: Path, flags: list[str]) -> list[str]:
    return [PYTHON, "-m", "torchrec_cloud", "launch", "--nnodes=1", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "torchrec_cloud", "train", *MODEL, "--output_dir", str(out),
            "--checkpoint_path", str(out / "ckpt"), *flags]  # fmt: skip


def _wait(what: str, ready: Callable[[], bool], proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise CheckFailed(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(0.1)
    raise CheckFailed(f"no {what} in {timeout:.0f}s")


def train_sigterm_resume(flags: list[str], expect_pipeline: str, expect_kernel: str) -> str:
    """Train with evaluations every 20 steps, SIGTERM the launcher after the first of them,
    resume with the same command to the end."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        args = ["--precision", "bf16", "--num_batches_per_epoch", "400", "--eval_every", "20", "--eval_rows", "16384",
                *flags]  # fmt: skip
        log = open(out / "first.log", "w")
        proc = subprocess.Popen(_launch(out, args), env=_env(), stdout=log, stderr=subprocess.STDOUT)
        _wait("an evaluation and 10 steps after it",
              lambda: any(r.get("event") == "train" and r["step"] >= 30 for r in _records(out)), proc, 600)  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
        log.close()
        records = _records(out)
        start = next(r for r in records if r.get("event") == "start")
        if start["backend"] != "nccl" or start["pipeline"] != expect_pipeline:
            raise CheckFailed(f"backend {start['backend']}, pipeline {start['pipeline']}")
        kernels = {t["compute_kernel"] for t in start["plan"]}
        if expect_kernel not in kernels:
            raise CheckFailed(f"kernels {sorted(kernels)}, expected {expect_kernel}")
        saved = [r for r in records if r.get("event") == "checkpoint" and r.get("reason") == "preempted"]
        if code != 200 or not saved:
            raise CheckFailed(f"after SIGTERM: exit {code} (200 expected), preempted checkpoint: {bool(saved)}; "
                              f"log {(out / 'first.log').read_text()[-2000:]}")  # fmt: skip
        again = subprocess.run(_launch(out, args), env=_env(), capture_output=True, text=True, timeout=900)
        records = _records(out)
        resumed = [r for r in records if r.get("event") == "resume"]
        end = [r for r in records if r.get("event") == "end"]
        val = [r for r in records if r.get("event") == "eval" and r.get("split") == "val"]
        if again.returncode != 0 or not resumed or not end or end[-1]["step"] != 400:
            raise CheckFailed(f"resume: exit {again.returncode}; {again.stdout[-1500:]}{again.stderr[-1500:]}")
        if val[-1]["rows"] != val[-1]["split_rows"] or not val[-1]["auc"] > 0.6:
            raise CheckFailed(f"final evaluation {val[-1]}")
        return (f"exit 200 at step {saved[-1]['step']} with a checkpoint, resumed to 400, val AUC {val[-1]['auc']:.4f}; "
                f"{end[-1]['samples_per_s']:,.0f} samples/s (not a benchmark)")  # fmt: skip


def _inner(name: str) -> str:
    """Run one in-process check in a fresh process (a process group of its own)."""
    proc = subprocess.run([PYTHON, __file__, "--inner", name], env=_env(), capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise CheckFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return lines[-1][len("RESULT "):]


def _trainer(flags: list[str]):
    from torchrec_cloud.build import build
    from torchrec_cloud.config import parse_job_config
    from torchrec_cloud.data.synthetic import SyntheticSource
    from torchrec_cloud.distributed import init_distributed

    cfg = parse_job_config([*MODEL, "--num_batches_per_epoch", "40", *flags])
    env = init_distributed(cfg.train.backend)
    return cfg, env, build(cfg, env), SyntheticSource(cfg, 0, 1)


def _steps(trainer, source, first: int, count: int) -> None:
    _steps_from(trainer, (source.make_batch("train", i).pin_memory() for i in range(first, first + count)))


def _steps_from(trainer, batches) -> None:
    """Train on ``batches`` through the pipeline, drained at the end as the loop's segments are."""
    it = iter(batches)
    while True:
        try:
            trainer.pipeline.progress(it)
        except StopIteration:
            return


def inner_cache_unlocked() -> str:
    """The lock counts of the cached tables' slots read inside an evaluation, before and after
    each of its forwards: a slot still locked when the next evaluation batch starts was held
    past its batch (fbgemm's inline prefetch locks, and only a backward unlocks)."""
    import torch

    from torchrec_cloud import compat
    from torchrec_cloud.metrics import MetricsSink
    from torchrec_cloud.train import _evaluate

    cfg, env, trainer, source = _trainer(["--embedding_kernel", "fused_uvm_caching", "--prefetch_pipeline",
                                          "--num_eval_batches", "16"])  # fmt: skip
    tbes = [m for m in compat.table_batched_modules(trainer.dmp) if m.lxu_cache_locking_counter.numel()]
    if not tbes or type(trainer.pipeline).__name__ != "PrefetchTrainPipelineSparseDist":
        raise CheckFailed(f"no cached table with prefetch_pipeline ({type(trainer.pipeline).__name__})")
    _steps(trainer, source, 0, 10)
    after_training = max(int(t.lxu_cache_locking_counter.max()) for t in tbes)
    before, after = [], []  # slots locked, at each evaluation forward of a TBE

    def locks(module) -> int:
        return int((module.lxu_cache_locking_counter > 0).sum())

    hooks = [h for t in tbes for h in (
        t.register_forward_pre_hook(lambda m, args: before.append(locks(m)) if not m.training else None),
        t.register_forward_hook(lambda m, args, out: after.append(locks(m)) if not m.training else None))]  # fmt: skip
    try:
        _evaluate(trainer, source, "val", 10, 0, env, MetricsSink(), {})
    finally:
        for h in hooks:
            h.remove()
    after_eval = max(int(t.lxu_cache_locking_counter.max()) for t in tbes)
    _steps(trainer, source, 10, 10)  # the prefetch pipeline attached again
    torch.cuda.synchronize()
    forwards = len(before) // len(tbes)
    if forwards < 8:
        raise CheckFailed(f"only {forwards} evaluation forwards seen per TBE (16 batches scored)")
    if after_training or max(before) or after_eval:
        raise CheckFailed(f"locked slots: {after_training} after training; during the evaluation up to {max(before)} "
                          f"locked when a batch started (held past the batch before), {max(after)} after a forward; "
                          f"{after_eval} after it")  # fmt: skip
    return (f"{len(tbes)} cached TBEs, {forwards} evaluation forwards each: no slot locked when a batch started or "
            f"after one (at most {max(after)}), none after training or the evaluation; 10 more steps trained")


def inner_host_lengths() -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cfg, env, trainer, source = _trainer([])

    def without_counts(batch):
        k = batch.sparse_features
        batch.sparse_features = KeyedJaggedTensor(keys=k.keys(), values=k.values(), lengths=k.lengths(), stride=k.stride())
        return batch

    def copies_back(make) -> int:
        batches = [make(source.make_batch("train", i)).pin_memory() for i in range(12)]
        _steps_from(trainer, batches[:4])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _steps_from(trainer, batches[4:])
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if "DtoH" in e.name or "Device -> Pageable" in e.name
                   or "Device -> Pinned" in e.name)  # fmt: skip

    ours, theirs = copies_back(lambda b: b), copies_back(without_counts)
    if ours >= theirs:
        raise CheckFailed(f"{ours} device-to-host copies for 8 steps of our batches, {theirs} without host counts")
    return f"device-to-host copies in 8 steps: {ours} with host-side length_per_key, {theirs} without"


def inner_pinned() -> str:
    cfg, env, trainer, source = _trainer(["--data_workers", "0"])
    batch = next(iter(source.train_batches_ahead(0, 0, 0, pin=True)))
    if not (batch.dense_features.is_pinned() and batch.sparse_features.values().is_pinned()):
        raise CheckFailed("a batch made with --data_workers 0 is not pinned")
    return "batches made in the step (--data_workers 0) are pinned"


def rng_devices() -> str:
    """A checkpoint of 1 GPU resumes on a CPU and one of a CPU on the GPU."""
    results = []
    for first, then in (("0", ""), ("", "0")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            # The same command twice: the second resumes from the first's final checkpoint (and,
            # the first run being finished, writes to run-2: metrics.run_folder).
            cmd = [PYTHON, "-m", "torchrec_cloud", "train", *MODEL, "--batch_size", "1024", "--num_embeddings", "1000",
                   "--num_batches_per_epoch", "20", "--output_dir", str(out / "run"), "--checkpoint_path",
                   str(out / "ckpt")]  # fmt: skip
            for visible in (first, then):
                proc = subprocess.run(cmd, env=_env(CUDA_VISIBLE_DEVICES=visible), capture_output=True, text=True,
                                      timeout=900)  # fmt: skip
                if proc.returncode != 0:
                    raise CheckFailed(f"CUDA_VISIBLE_DEVICES={visible!r}: exit {proc.returncode}: {proc.stderr[-1500:]}")
            resumed = [r for r in _records(out / "run-2") if r.get("event") == "resume"]
            if not resumed:
                raise CheckFailed("the second run did not resume")
            results.append(f"{'GPU' if first else 'CPU'} -> {'GPU' if then else 'CPU'}")
    return ", ".join(results) + ": resumed"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--inner"]:
        try:
            print("RESULT " + {"cache_unlocked": inner_cache_unlocked, "host_lengths": inner_host_lengths,
                               "pinned": inner_pinned}[argv[1]](), flush=True)  # fmt: skip
        except CheckFailed as e:
            print(f"RESULT FAILED {e}", flush=True)
            return 1
        return 0
    wanted = argv or list(CHECKS)
    unknown = [name for name in wanted if name not in CHECKS]
    if unknown:
        print(f"gpu_check: no check {', '.join(unknown)} (checks: {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    why_not = _no_gpu()
    runs: dict[str, Callable[[], str]] = {
        "fused": lambda: train_sigterm_resume(["--embedding_kernel", "fused"], "TrainPipelineSparseDist", "fused"),
        "uvm_prefetch": lambda: train_sigterm_resume(["--embedding_kernel", "fused_uvm_caching", "--prefetch_pipeline"],
                                                     "PrefetchTrainPipelineSparseDist", "fused_uvm_caching"),
        "cache_unlocked": lambda: _inner("cache_unlocked"),
        "host_lengths": lambda: _inner("host_lengths"),
        "rng_devices": rng_devices,
        "pinned": lambda: _inner("pinned"),
    }  # fmt: skip
    failed = not_run = 0
    for name in wanted:
        if why_not:
            print(f"NOT RUN {name}: {why_not}", flush=True)
            not_run += 1
            continue
        try:
            detail = runs[name]()
            if detail.startswith("FAILED "):
                raise CheckFailed(detail[len("FAILED "):])
            print(f"PASS {name}: {detail}", flush=True)
        except (CheckFailed, subprocess.TimeoutExpired, OSError) as e:
            print(f"FAIL {name}: {' '.join(str(e).split())[:1500]}", flush=True)
            failed += 1
    return 1 if failed else 3 if not_run else 0


def _no_gpu() -> Optional[str]:
    """Why no check can run here, or None."""
    probe = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.device_count())"], env=_env(),
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        return f"torch does not load ({probe.stderr.strip().splitlines()[-1:]})"
    if int(probe.stdout.strip() or 0) == 0:
        return "no CUDA GPU visible (torch.cuda.device_count() == 0)"
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
