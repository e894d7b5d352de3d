"""Checkpoints that survive preemption: sharded save/load with torch.distributed.checkpoint.

A checkpoint holds everything a run needs to continue exactly where it stopped: the
sharded model (``DistributedModelParallel.state_dict()``: embedding tables as
ShardedTensors with their global layout, dense layers as plain tensors), the fused
row-wise Adagrad state of the tables, the dense optimizer, the learning-rate schedule,
the step, the data position (epoch, batch) and each rank's RNG states. Because the
tables are saved with their global layout, a checkpoint written by 2 ranks loads on 1
rank or on 4: DCP reads each rank's new shards out of the saved ones.

The training loop uses it like this (see ``train.run``)::

    checkpoints = Checkpointer(cfg, env, sink)       # checks storage, finds what to resume
    position = checkpoints.load(dmp, optimizer, scheduler)   # when there is one
    ...
    if checkpoints.due(step):
        checkpoints.save(position, dmp, optimizer, scheduler)
    ...
    checkpoints.close()                               # waits for an async save to commit

Layout under ``--checkpoint_path`` (a folder, or an ``s3://``, ``gs://``, ``az://`` URL
through :mod:`torchrec_cloud.storage`)::

    step_00000200/
        __0_0.distcp  __1_0.distcp   one file of tensors per rank (DCP)
        .metadata                    DCP's index of every tensor and shard
        COMMIT.json                  written last, by rank 0, once every rank has finished

A checkpoint exists only once ``COMMIT.json`` is there and every file it lists has the
size it records: a save cut short by a crash or a kill, or a file truncated later, is
skipped with a warning naming it, and the newest complete one before it is used. Only
the newest ``--checkpoint_keep`` complete checkpoints are kept.

``COMMIT.json`` also holds a checksum of every 4 MiB of every file, computed as each rank
writes (or uploads) its files and handed to rank 0 with DCP's own write results. Resuming
checks each block a rank reads against them (:mod:`.dcp`), and ``.metadata`` before anything
is built: a damaged checkpoint is skipped with a warning naming the file, like an
incomplete one (with ``--resume_from``, it is an error).

SIGTERM (what Kubernetes and the clouds send before a spot or preemptible node goes
away) sets a flag; the loop finishes the step in progress, all ranks agree to stop, save
when the last save's measured time (:meth:`Checkpointer.save_estimate`) fits in what is left
of the grace, and every process exits with ``launch.EXIT_PREEMPTED``
(:mod:`torchrec_cloud.preemption`). Since the grace can be far shorter than a save,
``--checkpoint_every_s`` bounds the work a reclaim loses by saving on a clock.

Every start is listed in ``attempts.jsonl`` beside the checkpoints (the step it resumed
from); a start that resumes from the same step as the previous ``--no_progress_restarts``
starts gives up for good (:class:`NoProgressError`, exit 2): an eviction or crash loop that
never saves anything newer ends instead of running (and costing) forever.

``TORCHREC_CLOUD_TEST_SAVE_DELAY_S`` is for tests only: the time a save is expected to take
includes that many more seconds, and a save on SIGTERM waits them out, as for a model whose
save cannot fit a reclaim's grace (periodic saves do not wait).

Users look at checkpoints with ``torchrec-cloud checkpoint ls|inspect`` (:mod:`.cli`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import re
import time
import uuid
import warnings
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional

from torchrec_cloud import checksum, storage
from torchrec_cloud.checkpoint.dcp import (
    load_error,
    load_planner,
    metadata_problem,
    private_copy,
    reader,
    rng_keys,
    rng_state,
    set_rng_state,
    training_state,
    writer,
)
from torchrec_cloud.checkpoint.store import (
    COMMIT_FILE,
    FORMAT_VERSION,
    OWNER_FILE,
    CheckpointDamagedError,
    CheckpointError,
    CheckpointInfo,
    CheckpointWarning,
    apply_retention,
    checkpoint_name,
    inspect_checkpoint,
    list_checkpoints,
    newest_complete,
    recorded_owner,
    resolve,
    warn_skipped,
    write_owner,
)
from torchrec_cloud.checkpoint import warm
from torchrec_cloud.checkpoint.attempts import _KEEP_ATTEMPTS, ATTEMPTS_FILE, read_attempts
from torchrec_cloud.checkpoint.warm import VOCABULARY, check_descent, growth_only
from torchrec_cloud.compat import already_staged
from torchrec_cloud.config import JOB_ID, ConfigError, JobConfig
from torchrec_cloud.untrusted import shown

TEST_SAVE_DELAY_ENV = "TORCHREC_CLOUD_TEST_SAVE_DELAY_S"

if TYPE_CHECKING:  # torch loads only where a command needs it: `checkpoint ls` does not
    import torch


@dataclasses.dataclass
class Position:
    """Where training stands: steps done, and the next batch to train (epoch, batch index)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0

    @classmethod
    def after(cls, step: int, epoch: int, batch: int, batches_per_epoch: int) -> "Position":
        """The position after ``batch`` batches of ``epoch``; a finished epoch is the next one's start."""
        if batch >= batches_per_epoch:
            return cls(step, epoch + 1, 0)
        return cls(step, epoch, batch)


class NoProgressError(ConfigError):
    """Starts keep resuming from the same checkpoint: no retry can help (exit 2)."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.flag = "no_progress_restarts"


def _test_save_delay() -> float:
    try:
        return max(float(os.environ.get(TEST_SAVE_DELAY_ENV) or 0), 0.0)
    except ValueError:
        return 0.0


def _one_line(text: str, limit: int = 600) -> str:
    """Service errors carry multi-line bodies (XML, JSON); a start-up error is one line."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _agree(env, fn: Callable[[], Any], flag: str, storage_errors_are_flags: bool = True) -> Any:
    """Run ``fn`` on rank 0 and hand its result, or its error, to every rank, so a bad
    path fails all ranks at start-up instead of leaving some waiting in a collective (a
    storage error is one of ``flag``'s at start-up; later it stays a storage error)."""
    from torchrec_cloud import comm

    box: list[Any] = [None]
    if env.rank == 0:
        try:
            box[0] = ("ok", fn())
        except NoProgressError as e:
            box[0] = ("no progress", str(e))
        except ConfigError as e:
            box[0] = ("config", e.flag, str(e).split(": ", 1)[-1])
        except storage.StorageError as e:
            box[0] = ("config", flag, _one_line(str(e))) if storage_errors_are_flags else ("storage", e)
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks too
            box[0] = ("error", f"{type(e).__name__}: {e}")
    result = comm.broadcast_object(box[0], src=0)
    if result[0] == "no progress":
        raise NoProgressError(result[1])
    if result[0] == "storage":
        raise result[1]
    if result[0] == "config":
        raise ConfigError(result[1], result[2])
    if result[0] == "error":
        raise CheckpointError(f"rank 0 could not find the checkpoint to resume: {result[1]}")
    return result[1]


_RANDOM_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")


def named_job_id(flag: Optional[str]) -> Optional[str]:
    """The job id this run was given: ``--job_id``, else ``$TORCHREC_CLOUD_JOB_ID``, else
    torchrun's rendezvous id when one was named (``--rdzv_id``; not its default ``none``, nor
    the random one torchrun makes for a single-node run). None: no name was given."""
    if flag:
        return flag
    from_env = os.environ.get("TORCHREC_CLOUD_JOB_ID", "")
    if from_env:
        if not JOB_ID.fullmatch(from_env):
            raise ConfigError("job_id", f"$TORCHREC_CLOUD_JOB_ID must be 1 to 128 letters, digits or ._:@/+- , "
                              f"got {shown(from_env)}")  # fmt: skip
        return from_env
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id != "none" and JOB_ID.fullmatch(run_id) and not _RANDOM_ID.fullmatch(run_id):
        return run_id
    return None


@dataclasses.dataclass
class _PendingSave:
    future: Future
    path: str
    writer: Any
    trainer: dict[str, Any]
    start: float
    stall: float
    reason: str


class Checkpointer:
    """Saves, resumes and prunes the checkpoints of one run (see the module docstring).

    Built in the set-up phase, before the model: it checks that ``--checkpoint_path`` is
    reachable and writable with the credentials at hand, and finds the checkpoint to resume
    (``--resume_from``, else the newest complete one under ``--checkpoint_path``). Any
    problem is a :class:`ConfigError` naming the flag, before a single training step.
    """

    def __init__(self, cfg: JobConfig, env, sink, pinned: Optional[dict[str, str]] = None,
                 vocabulary: Optional[dict[str, Any]] = None) -> None:  # fmt: skip
        """``pinned``: the transforms of the data this run trains on (kind and digest, rank
        0's; ``data.dataset.PINNED``), recorded in every COMMIT.json it writes: what ``export``
        checks a dataset's transforms against. ``vocabulary``: its dataset's vocabulary section
        (``train._vocabulary``; None for data without vocabularies), whose version and digest
        every COMMIT.json records: what a warm start checks the next day's dataset against."""
        from torchrec_cloud import comm

        self.cfg = cfg
        self.pinned = pinned
        self.vocabulary = vocabulary
        self.ck = cfg.checkpoint
        self.env = env
        self.sink = sink
        self.root = self.ck.checkpoint_path
        self._last_step: Optional[int] = None
        self._pending: Optional[_PendingSave] = None
        self._async_group = None
        self._save_seconds: Optional[float] = None  # the last save's measured time, write included
        self._clock: Optional[float] = None  # when the time-based cadence last started counting
        self.cut = False  # set by train.agreed_batches: every rank stopped for a time-based save
        if self.root is not None:
            self._check_writable()
        self.resume_target: Optional[CheckpointInfo] = _agree(env, self._find_resume_target, "checkpoint_path")
        self.owner: Optional[str] = _agree(env, self._find_owner, "checkpoint_path") if self.root is not None else None
        if self.resume_target is not None:
            self._check_compatible(self.resume_target)
            if env.rank == 0:
                self._warn_other_transforms(self.resume_target)
            if self.resume_target.commit is not None:
                self._save_seconds = self.resume_target.commit.get("seconds")
        # --warm_start: a new run from another run's checkpoint, unless this run has its own.
        self.warm_target: Optional[CheckpointInfo] = None
        if self.resume_target is None and self.ck.warm_start is not None:
            self.warm_target = _agree(env, self._find_warm_target, "warm_start")
            self._check_compatible(self.warm_target, "warm_start")
            check_descent(self.warm_target, vocabulary, pinned)
        elif self.resume_target is not None and self.ck.warm_start is not None and env.rank == 0:
            print(f"--checkpoint_path {self.root} holds this run's own {self.resume_target.name}: resuming it "
                  f"(--warm_start {self.ck.warm_start} was for the run's first start)", file=sys.stderr, flush=True)  # fmt: skip
        self.last_step: Optional[int] = self.resume_target.step if self.resume_target is not None else None
        if self.root is not None:
            _agree(env, self._record_start, "checkpoint_path")
        if self.ck.async_checkpoint and self.root is not None:
            # The background save runs its own collectives; on the training group they
            # would interleave with the training thread's in a different order per rank.
            self._async_group = comm.background_group()

    @property
    def enabled(self) -> bool:
        return self.root is not None

    # -- start-up checks

    def _check_writable(self) -> None:
        """Every rank writes its own shards, so every rank checks its own access."""
        probe = storage.join(self.root, f".probe-rank{self.env.rank}-{os.getpid()}")
        error = ""
        try:
            storage.check_access(self.root)
            storage.makedirs(self.root)
            storage.write_bytes(probe, b"ok")
            storage.remove(probe)
        except storage.StorageError as e:
            error = _one_line(str(e))
        from torchrec_cloud import comm

        errors = comm.all_gather_object(error)
        for rank, message in enumerate(errors):
            if message:
                raise ConfigError(
                    "checkpoint_path", f"cannot write checkpoints (rank {rank}): {message}"
                )

    def _find_resume_target(self) -> Optional[CheckpointInfo]:
        if self.ck.resume_from is not None:
            target = resolve(self.ck.resume_from)
            problem = metadata_problem(target)
            if problem:
                raise ConfigError("resume_from", f"{target.path} is damaged: {problem}")
            newer = newest_complete(self.root, warn=False) if self.root is not None else None
            if newer is not None and (newer.step or 0) > (target.step or 0):
                warnings.warn(
                    f"--checkpoint_path {self.root} already holds {newer.name}, newer than "
                    f"--resume_from {target.path}; a restart without --resume_from would resume "
                    "from it, and it counts towards --checkpoint_keep. Use a fresh --checkpoint_path "
                    "to branch off an older checkpoint.",
                    CheckpointWarning,
                    stacklevel=2,
                )
            return target
        if self.root is not None:
            return newest_complete(self.root, check=metadata_problem)
        return None

    def _record_start(self) -> None:
        """Append this start to ``attempts.jsonl``; refuse it when the previous
        ``--no_progress_restarts`` starts of this job resumed from the same step (rank 0)."""
        path = storage.join(self.root, ATTEMPTS_FILE)
        named = named_job_id(self.ck.job_id)
        kept = read_attempts(self.root)
        # Another named job's starts are not this one's (a job that never saved leaves no
        # checkpoint to tell the owner by); an unnamed start counts every recorded one.
        history = [a["resumed_from"] for a in kept if named is None or a.get("job") in (None, named)]
        step = (self.resume_target.step or 0) if self.resume_target is not None else 0
        k = self.ck.no_progress_restarts
        # The end of a finished run: a start from it only evaluates, however often it runs.
        finished = self.resume_target is not None and (self.resume_target.commit or {}).get("reason") == "end"
        if k and not finished and len(history) >= k and all(h == step for h in history[-k:]):
            raise NoProgressError(
                f"no progress since step {step} in {k} restarts: the last {k} starts all resumed from "
                f"{'checkpoint step ' + str(step) if step else 'the beginning'} and none saved a newer "
                f"checkpoint (an eviction or crash loop; their logs say why); giving up for good. To try "
                f"again anyway: --no_progress_restarts 0, or remove {path}"
            )
        entry = {
            "resumed_from": step,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": self.env.world_size,
            **({"job": named} if named is not None else {}),
        }
        lines = [json.dumps(a) for a in [*kept[-(_KEEP_ATTEMPTS - 1):], entry]]
        storage.write_bytes(path, ("\n".join(lines) + "\n").encode())

    def _find_owner(self) -> str:
        """The job id this run records in its checkpoints (see --job_id). A named job does not
        start on a --checkpoint_path that holds another job's checkpoints; an unnamed one
        continues the job of the checkpoint it resumes (a restart, or the same command again)."""
        assert self.root is not None
        named = named_job_id(self.ck.job_id)
        found = [(i, recorded_owner(i)) for i in list_checkpoints(self.root) if i.complete]
        if named is None:
            target = self.resume_target
            if target is not None and self._is_ours(target) and recorded_owner(target):
                return recorded_owner(target)  # type: ignore[return-value]
            owned = [owner for _, owner in found if owner]
            return owned[-1] if owned else uuid.uuid4().hex[:16]
        others = [(i, owner) for i, owner in found if owner and owner != named]
        if others:
            info, other = others[-1]
            raise ConfigError(
                "checkpoint_path",
                f"{self.root} holds checkpoints of job {shown(other)} ({info.name}); this is job {named}: give each "
                f"job its own --checkpoint_path (or --job_id {shown(other)} to continue that job)",
            )
        return named

    def _claim(self, path: str) -> None:
        """Rank 0, before a save: clear ``path`` (the leftovers of a save that never committed, or
        this job's own checkpoint of that step) and mark it as this job's. Another job's
        checkpoint there, committed or being written, is never deleted: a ConfigError instead."""
        if storage.exists(path):
            info = inspect_checkpoint(path)
            other = recorded_owner(info)
            if other is not None and other != self.owner:
                state = "was committed" if info.complete else "is being written"
                raise ConfigError(
                    "checkpoint_path",
                    f"{path} {state} by job {shown(other)}; this job ({self.owner}) does not overwrite or delete "
                    "another job's checkpoint: give each job its own --checkpoint_path",
                )
            storage.remove(path, recursive=True)
        write_owner(path, self.owner or "")

    def _find_warm_target(self) -> CheckpointInfo:
        return warm.find_target(self.ck.warm_start)

    def _check_compatible(self, info: CheckpointInfo, flag: Optional[str] = None) -> None:
        saved = (info.commit or {}).get("config", {}).get("model")
        current = dataclasses.asdict(self.cfg.model)
        if saved is None or saved == current:
            return
        # A vocabulary that grew since the checkpoint: its tables keep their rows (grow.py).
        grew = flag == "warm_start" and growth_only(saved.get("num_embeddings_per_feature"),
                                                    current.get("num_embeddings_per_feature"))  # fmt: skip
        diffs = ", ".join(
            f"--{k} {saved.get(k)} (saved) vs {current.get(k)} (now)"
            for k in sorted(current)
            if saved.get(k) != current.get(k) and not (grew and k == "num_embeddings_per_feature")
        )
        if not diffs:  # saved by a version without some of today's fields, all at their defaults
            return
        flag = flag or ("resume_from" if self.ck.resume_from else "checkpoint_path")
        raise ConfigError(flag, f"{info.path} was written for a different model: {diffs}")

    def _warn_other_transforms(self, info: CheckpointInfo) -> None:
        """Resuming on data whose transforms differ from the checkpoint's (a dataset rebuilt,
        another day's vocabularies) is allowed, but every id may now reach another row: say so.
        The checkpoints this run writes record its own data's transforms."""
        saved = (info.commit or {}).get("pinned_transforms")
        if not isinstance(saved, dict) or self.pinned is None or saved.get("digest") == self.pinned["digest"]:
            return
        warnings.warn(f"{info.path} was trained on data whose transforms have digest {shown(str(saved.get('digest')))[:16]}; "
                      f"this run's have {self.pinned['digest'][:16]} (its ids may reach other rows of the tables); "
                      "the checkpoints it writes record this run's", CheckpointWarning, stacklevel=2)  # fmt: skip

    # -- resume

    def load(self, dmp: torch.nn.Module, optimizer: Any, scheduler: Any) -> Position:
        """Load the resume target into the sharded model, optimizers and schedule, in place;
        tables are resharded when the number of ranks changed. Returns where to continue.

        A block whose bytes differ from their checksum fails the load on every rank alike
        (DCP hands each rank every rank's error); then the previous complete checkpoint is
        loaded instead (its load overwrites every tensor the failed one touched), and
        ``resume_target`` names it. With --resume_from, or with none older, it is an error."""
        while True:
            info = self.resume_target
            assert info is not None and info.commit is not None
            try:
                return self._load(info, dmp, optimizer, scheduler)
            except CheckpointDamagedError as e:
                problem = f"{e.file}: {e.detail}"
                if self.ck.resume_from is not None:
                    raise ConfigError("resume_from", f"{info.path} is damaged: {problem}") from e
                older = _agree(self.env, lambda: newest_complete(self.root, check=metadata_problem, below=info.step),
                               "checkpoint_path")  # fmt: skip
                if older is None:
                    raise CheckpointError(
                        f"checkpoint {info.path} is damaged ({problem}) and there is no complete one before it; "
                        "move it away to start afresh"
                    ) from e
                if self.env.is_main:
                    warn_skipped(info.as_damaged(problem), older)
                self._check_compatible(older)
                self.resume_target = older

    def _load(self, info: CheckpointInfo, dmp: torch.nn.Module, optimizer: Any, scheduler: Any) -> Position:
        from torch.distributed.checkpoint import CheckpointException, load

        source = reader(info.path, info.commit, checksums=self.verifies(info))
        metadata = source.read_metadata()
        state = training_state(dmp, optimizer, self.env.rank, rng_keys(metadata, self.env.rank, self.env.device))
        try:
            load(state, storage_reader=source, planner=load_planner(info.path))
        except CheckpointDamagedError:
            raise
        except (CheckpointException, Exception) as e:
            raise load_error(info.path, e) from e
        dmp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        trainer = info.commit["trainer"]
        scheduler.load_state_dict(trainer["scheduler"])
        if "rng" in state:
            set_rng_state(state["rng"][f"rank_{self.env.rank}"], self.env.device)
        self._last_step = int(trainer["step"]) if self._is_ours(info) else None
        return Position(int(trainer["step"]), int(trainer["epoch"]), int(trainer["batch"]))

    def verifies(self, info: CheckpointInfo) -> bool:
        """Whether loading ``info`` checks what it reads against checksums."""
        return self.ck.checkpoint_checksums and info.checksums is not None

    def _is_ours(self, info: CheckpointInfo) -> bool:
        """Whether ``info`` lives under --checkpoint_path (then it need not be saved again)."""
        if self.root is None:
            return False
        ours = storage.join(self.root, info.name)
        if storage.is_url(ours):
            return info.path.rstrip("/") == ours.rstrip("/")
        return os.path.realpath(info.path) == os.path.realpath(ours)

    def load_warm(self, dmp: torch.nn.Module, optimizer: Any, scheduler: Any, model_cfg: Any, seed: int) -> Position:
        """Load ``warm_target`` into this new run (:func:`.warm.load`): its position is step 0."""
        assert self.warm_target is not None
        warm.load(self.warm_target, self.verifies(self.warm_target), self.vocabulary, dmp, optimizer, scheduler,
                  model_cfg, seed, self.env.rank)  # fmt: skip
        return Position()

    def resets_rows(self, info: CheckpointInfo) -> bool:
        """Whether this run's dataset reused rows since ``info``'s vocabulary (:func:`.warm.resets_rows`)."""
        return warm.resets_rows(info, self.vocabulary)

    # -- save

    def due(self, step: int) -> bool:
        """Whether to save after ``step``: its interval, or every rank stopped on the clock."""
        every = self.ck.checkpoint_interval
        return self.enabled and (self.cut or (bool(every) and step % every == 0))

    def time_due(self) -> bool:
        """This rank's clock says a ``--checkpoint_every_s`` save is due (the loop agrees on
        it with every rank, see ``train.agreed_batches``); it starts with training."""
        every = self.ck.checkpoint_every_s
        if not (self.enabled and every):
            return False
        now = time.monotonic()
        if self._clock is None:
            self._clock = now
        return now - self._clock >= every

    def save_estimate(self) -> Optional[float]:
        """Seconds a save is expected to take: the last one's (this run's, else the resumed
        checkpoint's); None when none was ever measured."""
        if self._save_seconds is None:
            return None
        return self._save_seconds + _test_save_delay()

    def save(self, position: Position, dmp: torch.nn.Module, optimizer: Any, scheduler: Any, reason: str = "interval") -> None:
        """Write a checkpoint of ``position`` (every rank calls this at the same step, with
        no batch in flight). Sync: returns once it is committed. Async: returns once the
        state is copied; the commit happens when the background write finishes."""
        self.cut = False
        self._clock = time.monotonic()
        if not self.enabled or position.step == self._last_step:
            return
        self.wait()  # the previous background save commits first (its stall counts the wait)
        if reason == "preempted" and _test_save_delay():
            time.sleep(_test_save_delay())  # tests: a save too large for the grace
        from torch.distributed.checkpoint import async_save, save

        from torchrec_cloud import comm

        start = time.perf_counter()
        path = storage.join(self.root, checkpoint_name(position.step))
        _agree(self.env, lambda: self._claim(path), "checkpoint_path", storage_errors_are_flags=False)
        trainer = {
            "step": position.step,
            "epoch": position.epoch,
            "batch": position.batch,
            "scheduler": scheduler.state_dict(),
        }
        state = training_state(dmp, optimizer, self.env.rank, rng_state(self.env.device))
        files = writer(path, checksums=self.ck.checkpoint_checksums)
        self._last_step = position.step
        try:
            if self._async_group is not None:
                future = async_save(
                    private_copy(state),
                    storage_writer=files,
                    process_group=self._async_group,
                    async_stager=already_staged(),
                )
                self._pending = _PendingSave(future, path, files, trainer, start, time.perf_counter() - start, reason)
                return
            save(state, storage_writer=files)
        except storage.StorageError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot save checkpoint {path}: {e}") from e
        comm.barrier()
        seconds = time.perf_counter() - start
        self._saved(position.step, seconds)
        self._commit(path, files, trainer, seconds, seconds, reason, is_async=False)

    def poll(self) -> None:
        """Commit a finished background save; cheap, call it between segments."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self, training_waits: bool = True) -> None:
        """Block until a background save is written, then commit it. Where training waits
        meanwhile, the time blocked is part of that save's stall, next to its copy."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        blocked = time.perf_counter()
        try:
            pending.future.result()
        except Exception as e:
            raise CheckpointError(f"background save of {pending.path} failed: {e}") from e
        now = time.perf_counter()
        stall = pending.stall + (now - blocked if training_waits else 0.0)
        self._saved(pending.trainer["step"], now - pending.start)
        # Rank 0 coordinates DCP's save: its future resolves only after every rank's
        # shards and the .metadata index are written, so it may commit without a barrier.
        self._commit(pending.path, pending.writer, pending.trainer, now - pending.start, stall, pending.reason,
                     is_async=True)  # fmt: skip

    def close(self) -> None:
        self.wait(training_waits=False)  # training is over: waiting for the write stalls no step

    @property
    def pending(self) -> bool:
        """A background save is being written."""
        return self._pending is not None

    def abandon(self) -> None:
        """Give up a background save in flight (the process is about to exit before it could
        finish): it is never committed, so no start ever sees it."""
        if self._pending is not None and self.env.is_main:
            print(f"the background save of {self._pending.path} cannot finish before the SIGKILL: not committed",
                  file=sys.stderr, flush=True)  # fmt: skip
        self._pending = None

    def _saved(self, step: int, seconds: float) -> None:
        """Every rank measures its own saves: any of them may be the one a SIGTERM reaches."""
        self._save_seconds = seconds
        self.last_step = step

    def _commit(self, path: str, files_writer: Any, trainer: dict, seconds: float, stall: float, reason: str,
                is_async: bool) -> None:  # fmt: skip
        if not self.env.is_main:
            return
        files = {
            name: storage.size(storage.join(path, name))
            for name in storage.listdir(path)
            if name not in (COMMIT_FILE, OWNER_FILE) and not name.startswith(".tmp-")
        }
        total = sum(files.values())
        commit: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "step": trainer["step"],
            "world_size": self.env.world_size,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "reason": reason,
            "async": is_async,
            "seconds": round(seconds, 4),
            "bytes": total,
            "files": files,
            "trainer": trainer,
            "config": self.cfg.to_dict(),
            "owner": self.owner,
        }
        if self.pinned is not None:
            commit["pinned_transforms"] = self.pinned
        if self.vocabulary is not None:
            commit[VOCABULARY] = {"version": self.vocabulary.get("version"), "digest": self.vocabulary.get("digest")}
        written = files_writer.file_checksums()
        if written is not None:
            commit["checksums"] = _checksums(path, files, written)
        storage.write_bytes(storage.join(path, COMMIT_FILE), json.dumps(commit, indent=1).encode())
        deleted = apply_retention(self.root, self.ck.checkpoint_keep, self.owner)
        self.sink.log(
            {
                "event": "checkpoint",
                "step": trainer["step"],
                "path": path,
                "seconds": round(seconds, 4),
                "stall_s": round(stall, 4),
                "bytes": total,
                "reason": reason,
                "async": is_async,
                "deleted": len(deleted),
                "world_size": self.env.world_size,
            }
        )


def _checksums(path: str, files: dict[str, int], written: dict[str, Optional[list[str]]]) -> dict[str, Any]:
    """COMMIT.json's ``checksums``: the block checksums computed as each file was written; a
    file that was not written in order (or whose size does not match them) is hashed now."""
    blocks = {}
    for name, size in files.items():
        found = written.get(name)
        if found is None or len(found) != checksum.block_count(size):
            found = checksum.hash_file(storage.join(path, name)).blocks()
        blocks[name] = found
    return {"algorithm": checksum.ALGORITHM, "block_bytes": checksum.BLOCK_BYTES, "files": blocks}
