"""Train a DLRM/DCNv2 model with TorchRec: set up, build, loop, evaluate.

One process (CPU, or one GPU)::

    torchrec-cloud train --preset quickstart --output_dir runs/q

One node, several processes (gloo on CPU, NCCL on GPUs)::

    torchrun --nproc_per_node=2 -m torchrec_cloud train --preset quickstart

N nodes (run on every node; the rendezvous host is node 0)::

    torchrun --nnodes=N --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 -m torchrec_cloud train --preset criteo-1tb ...

Rank 0 prints the sharding plan, shows a progress bar and writes ``metrics.jsonl`` and
TensorBoard event files to ``--output_dir``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from torchrec_cloud import observability
from torchrec_cloud.config import JobConfig, add_config_flags, config_from_args
from torchrec_cloud.data import DataSource, SyntheticSource, build_data_source
from torchrec_cloud.distributed import (
    Env,
    WarmupPolyDecay,
    build_optimizer,
    init_distributed,
    plan_summary,
    shard_model,
)
from torchrec_cloud.evaluation import evaluate
from torchrec_cloud.metrics import MetricsSink
from torchrec_cloud.model import build_model


def run(cfg: JobConfig, source: Optional[DataSource] = None) -> dict[str, Any]:
    """Train ``cfg``; returns the final val/test metrics (the same on every rank)."""
    # -- set up ------------------------------------------------------------------------
    env = init_distributed(cfg.train.backend, cfg.train.num_threads)
    torch.manual_seed(cfg.data.seed + env.rank)
    source = source or build_data_source(cfg, env.rank, env.world_size)
    sink = build_sinks(cfg, env)
    from tqdm import tqdm

    # -- build -------------------------------------------------------------------------
    model = build_model(cfg.model, dense_device=env.device)
    dmp, plan = shard_model(model, cfg, env)
    optimizer = build_optimizer(dmp, cfg.optimizer)
    scheduler = WarmupPolyDecay(optimizer, cfg.optimizer)
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    pipeline = TrainPipelineSparseDist(dmp, optimizer, env.device, execute_all_batches=True)
    if env.is_main:
        print(f"sharding plan ({env.world_size} rank(s), {env.device.type}):\n{plan_summary(plan)}")

    start_record: dict[str, Any] = {
        "event": "start",
        "step": 0,
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        "threads_per_rank": torch.get_num_threads(),
        "config": cfg.to_dict(),
    }
    if isinstance(source, SyntheticSource) and source.kind == "planted" and env.is_main:
        start_record["bayes_auc"] = source.bayes_auc("val")
    sink.log(start_record)

    # -- loop --------------------------------------------------------------------------
    batches_per_epoch = source.num_train_batches()
    total_steps = cfg.train.num_epochs * batches_per_epoch
    bar = tqdm(total=total_steps, disable=not (env.is_main and cfg.output.progress), unit="step")
    step, window = 0, _Window()
    last_val: dict[str, float] = {}
    run_start = time.perf_counter()
    for epoch in range(cfg.train.num_epochs):
        for first, last in segments(batches_per_epoch, cfg.train.eval_every, step):
            batches = agreed_batches(source.train_batches(epoch, first), last - first, window)
            while True:
                t0 = time.perf_counter()
                try:
                    loss, _, _ = pipeline.progress(batches)
                except StopIteration:
                    break
                window.in_step += time.perf_counter() - t0
                scheduler.step()
                step += 1
                window.add(loss, cfg.data.batch_size * env.world_size)
                bar.update(1)
                if step % cfg.train.log_every == 0:
                    record = window.record(step, epoch, env, scheduler.current_lr())
                    bar.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:.0f}")
                    sink.log(record)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                last_val = _evaluate(pipeline, source, "val", step, epoch, env, sink)
        if window.steps:
            sink.log(window.record(step, epoch, env, scheduler.current_lr()))
    bar.close()
    train_seconds = time.perf_counter() - run_start

    # -- evaluate ----------------------------------------------------------------------
    if not (cfg.train.eval_every and step % cfg.train.eval_every == 0):
        last_val = _evaluate(pipeline, source, "val", step, cfg.train.num_epochs - 1, env, sink)
    test = _evaluate(pipeline, source, "test", step, cfg.train.num_epochs - 1, env, sink)
    sink.log(
        {
            "event": "end",
            "step": step,
            "world_size": env.world_size,
            "seconds": round(train_seconds, 3),
            "samples_per_s": step * cfg.data.batch_size * env.world_size / max(train_seconds, 1e-9),
        }
    )
    sink.close()
    return {"step": step, "val": last_val, "test": test, "world_size": env.world_size}


# -- helpers beside the loop ----------------------------------------------------------


def build_sinks(cfg: JobConfig, env: Env) -> MetricsSink:
    """Rank 0 writes metrics.jsonl, TensorBoard events and console lines; with
    --prometheus_port every rank also serves its metrics (torchrec_cloud.observability)."""
    from tqdm import tqdm

    return observability.build_sinks(
        cfg, env.rank, env.local_rank, env.world_size, console_write=tqdm.write
    )


def segments(batches_per_epoch: int, eval_every: int, step: int) -> Iterator[tuple[int, int]]:
    """Split an epoch into [first, last) batch ranges that end where an evaluation is due.

    The pipeline drains at each boundary, so evaluation sees the model after exactly the
    batches before it.
    """
    first = 0
    while first < batches_per_epoch:
        last = batches_per_epoch
        if eval_every:
            due = eval_every - (step + first) % eval_every
            last = min(last, first + due)
        yield first, last
        first = last


def agreed_batches(batches: Iterator, limit: int, window: "_Window") -> Iterator:
    """Yield at most ``limit`` batches, stopping on every rank as soon as any rank runs out.

    Ranks with unequal batch counts would otherwise hang in the embedding all-to-all; one
    tiny all-reduce per batch makes them stop together.
    """
    distributed = dist.get_world_size() > 1
    for _ in range(limit):
        t0 = time.perf_counter()
        batch = next(batches, None)
        window.data_wait += time.perf_counter() - t0
        if distributed:
            have = torch.tensor([0 if batch is None else 1])
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
            if not bool(have.item()):
                if batch is not None:
                    warnings.warn("another rank ran out of training batches; stopping the epoch on all ranks")
                return
        if batch is None:
            return
        yield batch


class _Window:
    """Loss and throughput since the last train record."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.loss_sum: Optional[torch.Tensor] = None
        self.steps = 0
        self.samples = 0
        self.data_wait = 0.0  # inside next(batch iterator)
        self.in_step = 0.0  # inside pipeline.progress(), data wait included
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        loss = loss.detach().float()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.steps += 1
        self.samples += samples

    def record(self, step: int, epoch: int, env: Env, lr: float) -> dict[str, Any]:
        seconds = time.perf_counter() - self.start
        loss = self.loss_sum / max(self.steps, 1) if self.loss_sum is not None else torch.tensor(0.0)
        if env.world_size > 1:
            loss = loss.clone().to(env.device)
            dist.all_reduce(loss)
            loss = loss / env.world_size
        mean_loss = float(loss)
        record = {
            "event": "train",
            "step": step,
            "epoch": epoch,
            "split": "train",
            "loss": mean_loss,
            "logloss": mean_loss,
            "auc": None,
            "samples_per_s": self.samples / max(seconds, 1e-9),
            "lr": lr,
            "world_size": env.world_size,
            "data_wait_s": self.data_wait / max(self.steps, 1),
            "fwd_bwd_opt_s": max(self.in_step - self.data_wait, 0.0) / max(self.steps, 1),
            "step_s": seconds / max(self.steps, 1),
        }
        self._reset()
        return record


def _evaluate(pipeline, source, split, step, epoch, env, sink) -> dict[str, float]:
    model = pipeline.detach()  # the pipeline re-attaches on its next progress()
    metrics = evaluate(model, source, split, env.device)
    sink.log(
        {
            "event": "eval",
            "step": step,
            "epoch": epoch,
            "split": split,
            "loss": metrics["logloss"],
            "auc": metrics["auc"],
            "logloss": metrics["logloss"],
            "ne": metrics["ne"],
            "rows": metrics["rows"],
            "samples_per_s": metrics["rows"] / max(metrics["seconds"], 1e-9),
            "world_size": env.world_size,
        }
    )
    return metrics


# -- CLI ---------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a DLRM/DCNv2 model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser)
    parser.set_defaults(func=_main)
    return parser


def _main(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    quiet_library_warnings()
    try:
        run(cfg)
        # A rank that tears down while a peer is still in a collective kills the peer.
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def quiet_library_warnings() -> None:
    """TorchRec and torch warn about internals users cannot act on; keep the console readable."""
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|torchrec|fbgemm_gpu)\b.*")
    import logging

    for name in ("torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
