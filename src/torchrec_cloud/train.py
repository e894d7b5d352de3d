"""Train a DLRM/DCNv2 model with TorchRec: set up, build, loop, evaluate.

One process (CPU, or one GPU)::

    torchrec-cloud train --preset quickstart --output_dir runs/q

One node, several processes (gloo on CPU, NCCL on GPUs)::

    torchrun --standalone --nproc_per_node=2 -m torchrec_cloud train --preset quickstart

N nodes (run on every node; the rendezvous host is node 0)::

    torchrun --nnodes=N --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 -m torchrec_cloud train --preset criteo-1tb ...

Rank 0 prints the sharding plan and a line per ``--log_every`` steps (a progress bar
instead, in a terminal), and writes ``metrics.jsonl`` and TensorBoard event files to the
run folder: ``--output_dir``, or ``DIR-2``, ... when ``DIR`` holds another run
(:mod:`torchrec_cloud.metrics.run_folder`). ``--print_config`` prints the resolved config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from torchrec_cloud import comm, metrics
from torchrec_cloud.metrics import run_folder
from torchrec_cloud.build import Trainer, build
from torchrec_cloud.checkpoint import Checkpointer, Position
from torchrec_cloud.config import ConfigError, JobConfig, add_config_flags, config_from_args
from torchrec_cloud.data import DataSource, build_data_source, with_dataset_features
from torchrec_cloud.data.prefetch import EpochsAhead, TrainFeed
from torchrec_cloud.data.dataset import PINNED
from torchrec_cloud.distributed import Env, init_distributed, plan_summary
from torchrec_cloud.errors import CommandError
from torchrec_cloud.evaluation import evaluate
from torchrec_cloud.launch import EXIT_OK, EXIT_PREEMPTED, end_pod, report_finished, report_run
from torchrec_cloud.metrics import MetricsSink
from torchrec_cloud.precision import pins_batches, precision_context
from torchrec_cloud.preemption import Preemption, wait_for_lost_peer
from torchrec_cloud.progress import quiet_library_warnings


def run(cfg: JobConfig, source: Optional[DataSource] = None) -> dict[str, Any]:
    """Train ``cfg``; returns the final val/test metrics (the same on every rank)."""
    # -- set up ------------------------------------------------------------------------
    env = init_distributed(cfg.train.backend, cfg.train.num_threads, cfg.train.pg_timeout_s)
    torch.manual_seed(cfg.data.seed + env.rank)
    cfg = with_dataset_features(cfg)  # a dataset made from a schema names the model's features
    if env.is_main:  # only rank 0 writes there
        cfg = _in_run_folder(cfg)
    source = source or build_data_source(cfg, env.rank, env.world_size)
    # A dataset's vocabularies checked against its manifest, and the digest of its transforms
    # that every checkpoint records, before anything is built.
    facts = _data_facts(source, env)
    vocabulary = _vocabulary_of(source)  # what a checkpoint records; a warm start checks it
    bar_shown = env.is_main and cfg.output.progress and sys.stdout.isatty() and sys.stderr.isatty()
    sink = build_sinks(cfg, env, train_lines=not bar_shown)
    # Storage access and the checkpoint to resume are checked before anything is built.
    checkpoints = Checkpointer(cfg, env, sink, pinned=facts.get(PINNED), vocabulary=vocabulary)
    report_run(checkpoints.root)  # the launcher says which checkpoint a restart resumes from
    # SIGTERM: finish the step, save if the grace allows, stop
    preemption = Preemption(checkpoints.enabled, cfg.train.stop_stall_s, cfg.train.sigterm_grace_s)
    from tqdm import tqdm

    # -- build -------------------------------------------------------------------------
    trainer = build(cfg, env)  # the model, the speed-ups layer, sharding, optimizers, pipeline
    dmp, optimizer, scheduler, pipeline = trainer.dmp, trainer.optimizer, trainer.scheduler, trainer.pipeline
    if env.is_main:
        where = f"{env.world_size} rank{'s' if env.world_size > 1 else ''}, {env.device.type}, collectives: {trainer.collectives}"
        print(plan_summary(trainer.plan, f"sharding plan ({where})"), flush=True)

    batches_per_epoch = source.num_train_batches()
    total_steps = cfg.train.num_epochs * batches_per_epoch
    sink.log(_start_record(cfg, env, trainer, facts, total_steps, vocabulary, checkpoints))

    # -- resume, or warm-start -----------------------------------------------------------
    position = Position()
    if checkpoints.resume_target is not None:
        position = _resume(checkpoints, dmp, optimizer, scheduler, env, sink)
    elif checkpoints.warm_target is not None:
        position = _warm_start(checkpoints, dmp, optimizer, scheduler, cfg, env, sink)

    # -- loop --------------------------------------------------------------------------
    bar = tqdm(total=total_steps, initial=position.step, disable=not bar_shown, unit="step")
    start_step = step = position.step
    step_context = precision_context(cfg.train.precision, env.device)
    workers = _data_workers(cfg, env)
    window = _Window()
    finite = _FiniteLoss()
    last_val: dict[str, float] = {}
    val_step = -1  # the step at which the whole validation split was last scored
    intervals = (cfg.train.eval_every, cfg.checkpoint.checkpoint_interval)
    run_start = time.perf_counter()
    # One stream of batches for the run: its worker processes persist from segment to segment.
    feed = TrainFeed(_train_stream(source, cfg.train.num_epochs, workers, pins_batches(env.device)), batches_per_epoch)
    for epoch, first, last in (plan := Segments(position, cfg.train.num_epochs, batches_per_epoch, intervals)):
        made = feed.segment(epoch, first, last)
        batches = agreed_batches(made, last - first, window, preemption, checkpoints)
        segment_start = step
        while True:
            t0 = time.perf_counter()
            try:
                with step_context:
                    loss, _, _ = pipeline.progress(batches)
            except StopIteration:
                break
            window.in_step += time.perf_counter() - t0
            scheduler.step()
            step += 1
            window.add(loss, cfg.data.batch_size * env.world_size)
            finite.add(loss, step)
            bar.update(1)
            if step % cfg.train.log_every == 0:
                record = window.record(step, epoch, env, scheduler.current_lr())
                bar.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:.0f}")
                sink.log(record)
            preemption.reached(step)
        finite.check(checkpoints, preemption, sink)  # before anything is evaluated or saved
        done = first + step - segment_start
        if done < last and not (preemption.stop or checkpoints.cut):
            done = batches_per_epoch  # a rank ran out of batches: the epoch ends on every rank
        position = plan.position = Position.after(step, epoch, done, batches_per_epoch)
        if preemption.stop:
            break
        if position.batch == 0 and position.epoch > epoch and window.steps:  # the epoch's end
            sink.log(window.record(step, epoch, env, scheduler.current_lr()))
        if cfg.train.eval_every and step % cfg.train.eval_every == 0:
            # A fixed sample of the split (--eval_rows), at the last step the whole of it.
            rows = cfg.train.eval_rows if step < total_steps and cfg.train.eval_rows else None
            last_val = _evaluate(trainer, source, "val", step, epoch, env, sink, facts, rows)
            if last_val["rows"] == last_val["split_rows"]:
                val_step = step
        if checkpoints.due(step):
            checkpoints.save(position, dmp, optimizer, scheduler)
        checkpoints.poll()
    bar.close()
    feed.close()  # the data workers end here
    train_seconds = time.perf_counter() - run_start
    trained_steps = step - start_step

    # -- evaluate ----------------------------------------------------------------------
    test: dict[str, float] = {}
    if not preemption.stop:
        if val_step != step:
            last_val = _evaluate(trainer, source, "val", step, cfg.train.num_epochs - 1, env, sink, facts)
        test = _evaluate(trainer, source, "test", step, cfg.train.num_epochs - 1, env, sink, facts)

    # -- save --------------------------------------------------------------------------
    # A run stopped before its first step has nothing new to save (and little grace time).
    if not preemption.stop:
        checkpoints.save(position, dmp, optimizer, scheduler, reason="end")
    elif step != start_step and _save_on_stop(step, preemption, checkpoints, env):
        checkpoints.save(position, dmp, optimizer, scheduler, reason="preempted")
    checkpoints.close()
    preemption.close()
    sink.log(_end_record(step, trained_steps, train_seconds, cfg, env, preemption.stop))
    sink.close()
    return {
        "step": step,
        "val": last_val,
        "test": test,
        "world_size": env.world_size,
        "preempted": preemption.stop,
        "sigterm": preemption.requested,
    }


# -- helpers beside the loop ----------------------------------------------------------


def _in_run_folder(cfg: JobConfig) -> JobConfig:
    """``cfg`` writing to its run folder: ``--output_dir``, unless that holds another run."""
    folder, note = run_folder.choose(cfg.output.output_dir, cfg.to_dict())
    if note:
        print(note, flush=True)
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, output_dir=str(folder)))


def _data_facts(source: DataSource, env: Env) -> dict[str, Any]:
    """What the data source says about its data, on rank 0 (for the start record; for a
    dataset, the transforms checkpoints pin, once its vocabularies match the manifest); a
    problem there stops every rank with one line (the others would wait in a collective)."""
    facts, problem = {}, None
    if env.is_main:
        try:
            facts = source.facts()
        except ConfigError as e:
            problem = (e.flag, str(e).removeprefix(f"--{e.flag}: "))
        except CommandError as e:
            problem = ("dataset_path", str(e))
    problem = comm.broadcast_object(problem)
    if problem is not None:
        raise ConfigError(*problem)
    return facts


def _vocabulary(dataset: Any) -> Optional[dict[str, Any]]:
    """The vocabulary section of a schema dataset's manifest (``version``, ``digest``,
    ``parent``, ``ancestors``, ``reset_rows``: :func:`~torchrec_cloud.data.vocab.vocabulary_section`,
    checked as untrusted input), or None when no feature maps by vocabulary (hash and modulo
    mappings keep every id's row by construction). A section that is not as preprocessing
    writes it stops the run in one line (``--dataset_path``) before a row is reset; a reused
    row must be a row of its feature's table."""
    from torchrec_cloud.data.vocab import vocabulary_section
    from torchrec_cloud.untrusted import UntrustedInputError

    if not any(f.mapping == "vocab" for f in dataset.schema.sparse):
        return None
    try:
        section = vocabulary_section(dataset.manifest, dataset.manifest_url)
        sizes = dict(zip((f.name for f in dataset.schema.sparse), dataset.table_sizes))
        for name, rows in section["reset_rows"].items():
            if any(r >= sizes[name] for r in rows):
                raise UntrustedInputError(dataset.manifest_url, f"vocabulary.reset_rows.{name}",
                                          f"names a row past its table's {sizes[name]}")  # fmt: skip
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", f"{e} (a damaged or altered manifest)") from None
    return section


def _vocabulary_of(source: DataSource) -> Optional[dict[str, Any]]:
    """:func:`_vocabulary` of the source's dataset; None for other sources (synthetic, Criteo)."""
    dataset = getattr(source, "dataset", None)
    if dataset is None or not hasattr(dataset, "schema") or not isinstance(getattr(dataset, "manifest", None), dict):
        return None
    return _vocabulary(dataset)


def _start_record(cfg: JobConfig, env: Env, trainer: Trainer, facts: dict[str, Any], total_steps: int,
                  vocabulary: Optional[dict[str, Any]] = None, checkpoints: Optional[Checkpointer] = None,
                  ) -> dict[str, Any]:  # fmt: skip
    """The run's first record: where it runs, how the step communicates, what the speed-ups
    layer applied, where each table went (``plan``: the sharding plan it trains with, to
    compare with ``torchrec-cloud plan``), the whole config; on rank 0, what the data source
    knows (``bayes_auc``); the dataset's vocabulary (version and digest) and, for a warm
    start, its ``parent`` (the checkpoint, its step and its vocabulary's digest)."""
    record: dict[str, Any] = {
        "event": "start",
        "step": 0,
        "total_steps": total_steps,
        "world_size": env.world_size,
        "backend": env.backend,
        "collectives": trainer.collectives,
        "speedups": trainer.speedups.record(),
        "device": env.device.type,
        "pipeline": type(trainer.pipeline).__name__,
        "plan": trainer.tables,  # as `torchrec-cloud plan --json` lists its tables
        "threads_per_rank": torch.get_num_threads(),
        "config": cfg.to_dict(),
        **facts,
    }
    if vocabulary is not None:
        record["vocabulary"] = {"version": vocabulary.get("version"), "digest": vocabulary.get("digest")}
    warm = checkpoints.warm_target if checkpoints is not None else None
    if warm is not None:
        from torchrec_cloud.checkpoint.warm import saved_vocabulary_digest

        record["parent"] = {"path": warm.path, "step": warm.step, "vocabulary_digest": saved_vocabulary_digest(warm)}
    return record


def _end_record(step: int, steps: int, seconds: float, cfg: JobConfig, env: Env, preempted: bool) -> dict[str, Any]:
    """The run's last record: ``steps`` trained in ``seconds`` (resumed steps not counted)."""
    return {
        "event": "end",
        "step": step,
        "world_size": env.world_size,
        "seconds": round(seconds, 3),
        "samples_per_s": steps * cfg.data.batch_size * env.world_size / max(seconds, 1e-9),
        "preempted": preempted,
    }


def _data_workers(cfg: JobConfig, env: Env) -> int:
    """``--data_workers``, or its default: on a GPU the rank's cores less two (at most 16),
    on a CPU none (the step's own threads use every core)."""
    if cfg.data.data_workers is not None:
        return cfg.data.data_workers
    return min(16, max(1, torch.get_num_threads() - 2)) if env.device.type == "cuda" else 0


def _train_stream(source: DataSource, num_epochs: int, workers: int, pin: bool) -> Any:
    """``source``'s stream of training batches for the run (``DataSource.train_stream``; a
    source that does not name ``DataSource`` as its base gets the default)."""
    if hasattr(source, "train_stream"):
        return source.train_stream(num_epochs, workers, pin)
    return EpochsAhead(source, num_epochs, workers, pin)


def build_sinks(cfg: JobConfig, env: Env, train_lines: bool = True) -> MetricsSink:
    """Rank 0 writes metrics.jsonl, TensorBoard events and console lines (a line per train
    record unless ``train_lines`` is off: a progress bar shows them); with --prometheus_port
    every rank also serves its metrics (torchrec_cloud.metrics)."""
    from tqdm import tqdm

    write = tqdm.write if not train_lines else lambda line: print(line, flush=True)
    sink, error = None, ""
    try:
        sink = metrics.build_sinks(cfg, env.rank, env.local_rank, env.world_size, write, train_lines)
    except OSError as e:  # only rank 0 writes there; every rank must stop, not wait for it
        error = f"cannot write metrics under {cfg.output.output_dir} ({e.strerror or e})"
    problems = [m for m in comm.all_gather_object(error) if m]
    if problems:
        if sink is not None:
            sink.close()
        raise ConfigError("output_dir", problems[0])
    return sink


class Segments:
    """``(epoch, first, last)`` batch ranges from ``position`` to the end of training, each
    ending where the step count reaches a multiple of one of ``intervals`` (evaluation,
    checkpoints) or at the end of an epoch. The loop sets ``position`` after each segment,
    which may have ended early (a time-based checkpoint, see :func:`agreed_batches`): the
    next one starts there.

    The pipeline drains at each boundary, so evaluation and checkpoints see the model after
    exactly the batches before them, with none in flight, and the data position is exact.
    """

    def __init__(self, position: Position, num_epochs: int, batches_per_epoch: int, intervals: tuple[int, ...]) -> None:
        self.position = position
        self.num_epochs, self.batches_per_epoch, self.intervals = num_epochs, batches_per_epoch, intervals

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        while True:
            p = Position.after(self.position.step, self.position.epoch, self.position.batch, self.batches_per_epoch)
            if p.epoch >= self.num_epochs:
                return
            last = self.batches_per_epoch
            for every in self.intervals:
                if every:
                    last = min(last, p.batch + every - p.step % every)
            yield p.epoch, p.batch, last


def agreed_batches(batches: Iterator, limit: int, window: "_Window", preemption: Preemption,
                   checkpoints: Optional[Checkpointer] = None) -> Iterator:  # fmt: skip
    """Yield at most ``limit`` batches, stopping on every rank as soon as any rank runs out,
    any rank received SIGTERM, or any rank's clock says a time-based checkpoint is due
    (``--checkpoint_every_s``: ``checkpoints.cut`` is then set).

    Ranks with unequal batch counts would otherwise hang in the embedding all-to-all; one
    tiny all-reduce per batch makes them stop together. The same all-reduce carries the
    preemption flag and the checkpoint clock, so all ranks stop after the same step and
    save the same position. The agreement on a batch is started when the batch is fetched,
    one batch ahead of the one handed to the pipeline, so it completes while a step runs
    (comm.all_min_async).
    """
    clock = checkpoints.time_due if checkpoints is not None else (lambda: False)

    def fetch() -> tuple[Any, Any]:
        preemption.beat()
        if checkpoints is not None:
            checkpoints.poll()  # a background save commits as soon as it is written
        t0 = time.perf_counter()
        batch = next(batches, None)
        window.data_wait += time.perf_counter() - t0
        return batch, comm.all_min_async([batch is not None, not preemption.requested, not clock()])

    preemption.training(True)
    try:
        ahead = fetch() if limit > 0 else None
        for i in range(limit):
            batch, agreement = ahead
            # Every rank starts the next agreement before reading this one, so all ranks issue
            # the same sequence of all-reduces whichever batch they stop at.
            ahead = fetch() if i + 1 < limit else None
            t0 = time.perf_counter()
            have, go_on, on_time = agreement()
            window.data_wait += time.perf_counter() - t0
            on_time = on_time or i == 0  # a segment trains a batch before its time-based save
            if not (have and go_on and on_time):
                if ahead is not None:
                    ahead[1]()  # completes on every rank; nothing is left in flight
                if not have and batch is not None:
                    warnings.warn("another rank ran out of training batches; stopping the epoch on all ranks")
                if have and not go_on:
                    preemption.stop = True
                elif have and checkpoints is not None:
                    checkpoints.cut = True  # the loop saves here and goes on
                return
            yield batch
    finally:
        preemption.training(False)


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
        mean_loss = comm.mean(loss)
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


class NonFiniteLossError(CommandError):
    """The training loss was NaN or infinite: the run stops, saving nothing."""


class _FiniteLoss:
    """The first step whose loss was not finite, kept where the loss is (no sync a step), and
    agreed by every rank at the end of each segment, before anything is evaluated or saved:
    a NaN spreads to every weight at the next update, so nothing after it is worth keeping."""

    def __init__(self) -> None:
        self.first: Optional[torch.Tensor] = None

    def add(self, loss: torch.Tensor, step: int) -> None:
        mark = torch.where(torch.isfinite(loss.detach()), 0, step)
        self.first = mark if self.first is None else torch.where(self.first > 0, self.first, mark)

    def check(self, checkpoints: Checkpointer, preemption: Preemption, sink: MetricsSink) -> None:
        mine = int(self.first) if self.first is not None else 0
        step = comm.all_min([mine if mine > 0 else 2**62])[0]
        if step == 2**62:
            return
        checkpoints.close()  # a save still being written is of an earlier step: let it commit
        last = checkpoints.last_step
        preemption.close()
        sink.close()
        kept = f"the last checkpoint (step {last}) is kept" if last is not None else "no checkpoint was saved"
        raise NonFiniteLossError(f"step {step}: the training loss is not finite (NaN or inf); stopped without saving, "
                                 f"{kept}. Look for extreme values in the data, or lower --learning_rate")  # fmt: skip


def _save_on_stop(step: int, preemption: Preemption, checkpoints: Checkpointer, env: Env) -> bool:
    """Every rank stopped at ``step`` for a SIGTERM: all agree to finish a background save in
    flight, and to save this step, only as far as that fits in what is left of the grace on
    every rank that got one (the last save's measured time, with a margin), since a save cut
    short by the SIGKILL saves nothing and leaves the other pods waiting on the killed one.
    Rank 0 says which checkpoint the next start resumes from."""
    if not checkpoints.enabled:
        if env.is_main:
            print(f"stopping at step {step} on every rank for a preemption (SIGTERM); nothing is saved "
                  "(no --checkpoint_path): the next start begins at step 0", file=sys.stderr, flush=True)  # fmt: skip
        return False
    estimate = checkpoints.save_estimate()
    saves = 2 if checkpoints.pending else 1  # a save waits for the one in flight first
    left = preemption.time_left()
    both, pending_only, left_ms, minus_estimate_ms = comm.all_min([
        preemption.save_fits(None if estimate is None else estimate * saves),
        preemption.save_fits(estimate) if checkpoints.pending else 0,
        int(1e12 if left is None else left * 1000),
        int(-1000 * (estimate or 0)),
    ])  # fmt: skip
    if not both:
        if pending_only:
            checkpoints.wait(training_waits=False)
        else:
            checkpoints.abandon()  # its write cannot finish in time: the next start does without it
    if env.is_main:
        known = f"a save took {-minus_estimate_ms / 1000:.1f} s" if estimate is not None else "no save measured yet"
        grace = f"{left_ms / 1000:.1f} s of the grace left" if left_ms < 1e12 else "no grace given"
        if both:
            then = f"saving checkpoint step {step} ({known}, {grace})"
        else:
            last = checkpoints.last_step
            then = (f"not saving ({known}, {grace}): the next start resumes from "
                    + (f"checkpoint step {last}" if last is not None else "step 0 (no checkpoint yet)"))  # fmt: skip
        print(f"stopping at step {step} on every rank for a preemption (SIGTERM); {then}", file=sys.stderr, flush=True)
    return bool(both)


def _evaluate(trainer: Trainer, source: DataSource, split: str, step: int, epoch: int, env: Env, sink: MetricsSink,
              facts: dict[str, Any], rows: Optional[int] = None) -> dict[str, Any]:  # fmt: skip
    """Score ``split`` (a sample of ``rows`` of it, or all) between two training segments
    (no batch in flight), and log it. The training pipeline is detached for it and attached
    again, as TorchRec documents the pair (torchrec 1.8.0 train_pipelines.py
    ``TrainPipelineSparseDist.detach``): only ``TrainPipelineSparseDist.progress`` attaches
    a detached model by itself, ``PrefetchTrainPipelineSparseDist.progress`` does not and
    would call ``set_context`` on the plain forwards detach put back."""
    pipeline = trainer.pipeline
    model = pipeline.detach()
    try:
        metrics = evaluate(model, trainer.optimizer, source, split, env.device, rows)
    finally:
        pipeline.attach(model)
    # The data's best AUC is known for the whole split, not for a sample of it.
    whole = metrics["rows"] == metrics["split_rows"]
    bayes = (facts.get("bayes_auc_by_split") or {}).get(split) if whole else None
    sink.log(
        {
            **({"bayes_auc": bayes} if bayes is not None else {}),
            "event": "eval",
            "step": step,
            "epoch": epoch,
            "split": split,
            "loss": metrics["logloss"],
            "auc": metrics["auc"],
            "logloss": metrics["logloss"],
            "ne": metrics["ne"],
            "rows": metrics["rows"],
            "split_rows": metrics["split_rows"],
            "samples_per_s": metrics["rows"] / max(metrics["seconds"], 1e-9),
            "world_size": env.world_size,
        }
    )
    return metrics


def _resume(checkpoints: Checkpointer, dmp, optimizer, scheduler, env: Env, sink: MetricsSink) -> Position:
    start = time.perf_counter()
    position = checkpoints.load(dmp, optimizer, scheduler)
    target = checkpoints.resume_target  # the one loaded: an older one where the newest was damaged
    sink.log(
        {
            "event": "resume",
            "step": position.step,
            "epoch": position.epoch,
            "batch": position.batch,
            "path": target.path,
            "seconds": round(time.perf_counter() - start, 4),
            "bytes": target.bytes,
            "saved_world_size": target.world_size,
            "world_size": env.world_size,
            "verified": checkpoints.verifies(target),
        }
    )
    return position


def _warm_start(checkpoints: Checkpointer, dmp, optimizer, scheduler, cfg: JobConfig, env: Env,
                sink: MetricsSink) -> Position:  # fmt: skip
    start = time.perf_counter()
    target = checkpoints.warm_target
    reset = checkpoints.resets_rows(target)
    position = checkpoints.load_warm(dmp, optimizer, scheduler, cfg.model, cfg.data.seed)
    rows = (checkpoints.vocabulary or {}).get("reset_rows") or {} if reset else {}
    sink.log(
        {
            "event": "warm_start",
            "step": 0,
            "path": target.path,
            "parent_step": target.step,
            "seconds": round(time.perf_counter() - start, 4),
            "saved_world_size": target.world_size,
            "world_size": env.world_size,
            "reset_rows": {feature: len(r) for feature, r in sorted(rows.items())},
        }
    )
    return position


# -- CLI ---------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a DLRM/DCNv2 model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser)
    parser.add_argument("--print_config", action="store_true",
                        help="print the resolved config (the preset with the flags applied) as JSON and exit")
    parser.set_defaults(func=_main)
    return parser


def _main(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    if ns.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    quiet_library_warnings()
    try:
        result = run(cfg)
        # A rank that tears down while a peer is still in a collective kills the peer.
        comm.barrier()
    except Exception as e:
        wait_for_lost_peer(e)  # a peer pod's loss is the launcher's to report, not a crash
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not result["preempted"]:
        report_finished(result["step"])
        return EXIT_OK
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # done: the launcher's SIGTERM to its workers is moot
    # Not finished: never exit 0 (a pod that does is never started again). The ranks that
    # stopped because another one was preempted ask their launcher to end the pod too,
    # rather than restart them into a rendezvous that waits for the preempted pod.
    if not result["sigterm"]:
        end_pod(EXIT_PREEMPTED)
    return EXIT_PREEMPTED
