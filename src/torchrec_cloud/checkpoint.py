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

SIGTERM (what Kubernetes and the clouds send before a spot or preemptible node goes
away) sets a flag; the loop finishes the step in progress, all ranks agree to stop,
save, and every process exits with ``launch.EXIT_PREEMPTED`` (:class:`Preemption`).

Users look at checkpoints with::

    torchrec-cloud checkpoint ls s3://bucket/runs/q
    torchrec-cloud checkpoint inspect s3://bucket/runs/q/step_00000200
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import random
import re
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, JobConfig

if TYPE_CHECKING:  # torch loads only where a command needs it: `checkpoint ls` does not
    import torch

COMMIT_FILE = "COMMIT.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete or damaged)."""


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint after ``step`` steps; sorts by step."""
    return f"step_{step:08d}"


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


# -- Finding checkpoints --------------------------------------------------------------


@dataclasses.dataclass
class CheckpointInfo:
    """One checkpoint folder and whether it is complete (``problem`` says why not)."""

    path: str
    step: Optional[int]
    complete: bool
    problem: str = ""
    commit: Optional[dict[str, Any]] = None

    @property
    def name(self) -> str:
        return self.path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]

    @property
    def world_size(self) -> Optional[int]:
        return self.commit.get("world_size") if self.commit else None

    @property
    def bytes(self) -> Optional[int]:
        return self.commit.get("bytes") if self.commit else None


def inspect_checkpoint(path: str) -> CheckpointInfo:
    """Read one checkpoint folder's commit and check that every file it lists is whole."""
    match = _NAME.match(path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1])
    step = int(match.group(1)) if match else None
    commit_path = storage.join(path, COMMIT_FILE)
    try:
        raw = storage.read_bytes(commit_path)
    except storage.StorageNotFoundError:
        present = storage.exists(storage.join(path, ".metadata"))
        problem = (
            f"no {COMMIT_FILE}: the save did not finish on every rank"
            if present or _has_files(path)
            else f"not a checkpoint (no {COMMIT_FILE}, no .metadata)"
        )
        return CheckpointInfo(path, step, False, problem)
    try:
        commit = json.loads(raw)
        files: dict[str, int] = commit["files"]
        step = int(commit["step"])
    except (ValueError, KeyError, TypeError) as e:
        return CheckpointInfo(path, step, False, f"{COMMIT_FILE} is unreadable ({e})")
    for name, expected in sorted(files.items()):
        file_path = storage.join(path, name)
        try:
            actual = storage.size(file_path)
        except storage.StorageNotFoundError:
            return CheckpointInfo(path, step, False, f"{name} is missing", commit)
        if actual != expected:
            return CheckpointInfo(
                path, step, False, f"{name} has {actual} bytes, the commit says {expected} (truncated)", commit
            )
    return CheckpointInfo(path, step, True, "", commit)


def _has_files(path: str) -> bool:
    try:
        return bool(storage.listdir(path))
    except storage.StorageNotFoundError:
        return False


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Every ``step_N`` folder under ``root``, oldest first, each checked for completeness."""
    try:
        names = storage.listdir(root)
    except storage.StorageNotFoundError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := _NAME.match(n)))
    return [inspect_checkpoint(storage.join(root, name)) for _, name in found]


def newest_complete(root: str, warn: bool = True) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint under ``root``; newer incomplete ones are skipped with
    a :class:`CheckpointWarning` naming them and the checkpoint used instead."""
    try:
        names = storage.listdir(root)
    except storage.StorageNotFoundError:
        return None
    found = sorted(((int(m.group(1)), n) for n in names if (m := _NAME.match(n))), reverse=True)
    skipped: list[CheckpointInfo] = []
    chosen = None
    for _, name in found:
        info = inspect_checkpoint(storage.join(root, name))
        if info.complete:
            chosen = info
            break
        skipped.append(info)
    if warn:
        for info in skipped:
            instead = f"using {chosen.path}" if chosen else "no complete checkpoint before it; starting fresh"
            warnings.warn(
                f"skipping incomplete checkpoint {info.path}: {info.problem}; {instead}",
                CheckpointWarning,
                stacklevel=2,
            )
    return chosen


def resolve(path: str) -> CheckpointInfo:
    """The checkpoint that ``--resume_from PATH`` means: PATH itself, or, for a folder of
    checkpoints, its newest complete one. Anything else raises :class:`ConfigError`."""
    info = inspect_checkpoint(path)
    if info.complete:
        return info
    if info.commit is None and not storage.exists(storage.join(path, ".metadata")):
        newest = newest_complete(path)
        if newest is not None:
            return newest
        listed = list_checkpoints(path)
        if listed:
            problems = "; ".join(f"{i.name}: {i.problem}" for i in listed)
            raise ConfigError("resume_from", f"{path} holds no complete checkpoint ({problems})")
        if not storage.exists(path):
            raise ConfigError("resume_from", f"{path} does not exist")
        raise ConfigError(
            "resume_from",
            f"{path} is not a checkpoint (no {COMMIT_FILE}) nor a folder of step_N checkpoints; "
            "`torchrec-cloud checkpoint ls` shows what is there",
        )
    raise ConfigError("resume_from", f"{path} is not a complete checkpoint: {info.problem}")


def apply_retention(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (0 keeps all),
    and incomplete leftovers older than the newest complete one. Returns what was deleted.

    Works the same on every backend: it only lists, inspects and removes through storage.
    """
    listed = list_checkpoints(root)
    complete = [i for i in listed if i.complete]
    if not complete:
        return []
    newest_step = complete[-1].step or 0
    doomed = [i for i in listed if not i.complete and (i.step or 0) < newest_step]
    if keep:
        doomed += complete[:-keep]
    for info in doomed:
        storage.remove(info.path, recursive=True)
    return [i.path for i in doomed]


# -- What goes into a checkpoint ------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(dmp: torch.nn.Module, optimizer: Any, rank: int, with_rng: bool = True) -> dict[str, Any]:
    """The state dict DCP saves and loads in place.

    ``model``: ``dmp.state_dict()`` has the same keys on any number of ranks (DMP strips
    the DDP ``module.`` prefix of the dense part); tables are ShardedTensors. ``optimizer``:
    the CombinedOptimizer's state by parameter FQN: the fused row-wise Adagrad's
    ``<table>.momentum1`` ShardedTensors (each rank lists its own tables) and the dense
    Adagrad's ``sum``/``step``. RNG states differ per rank, so each has its own key.
    """
    state: dict[str, Any] = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
    if with_rng:
        state["rng"] = {f"rank_{rank}": _rng_state()}
    return state


def _private_copy(state: Any) -> Any:
    """A copy of the state that training cannot change while a background thread writes it.

    DCP's default stager deep-copies each ShardedTensor. TorchRec's table shards are views
    into one buffer holding all of a rank's tables, and deep-copying a view copies its whole
    buffer: once per table (26 x 650 MB for the quickstart model, 30 s instead of 1).
    Cloning a shard copies only its own rows.
    """
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(state, dict):
        return {key: _private_copy(value) for key, value in state.items()}
    if isinstance(state, ShardedTensor):
        local = state.local_shards()
        if local and local[0].tensor.device.type != "cpu":
            return state.to("cpu")  # copies each local shard's rows to host memory
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in local]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, state.metadata(), process_group=state._process_group
        )
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


def _already_staged():
    """An AsyncStager for a state dict that is already a private copy (see _private_copy)."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class AlreadyStaged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return AlreadyStaged()


# -- Storage for DCP ------------------------------------------------------------------


def _dcp_storage(path: str, write: bool):
    """DCP's file-system writer/reader for a local folder, or bound to the storage layer's
    fsspec client for a bucket URL (one place decides URL options and credentials)."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if write:
        # Object stores publish a file when its upload completes; fsync is for local disks.
        handle = FileSystemWriter(path, sync_files=not storage.is_url(path))
    else:
        handle = FileSystemReader(path)
    if storage.is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

        class StorageFileSystem(FsspecFileSystem):
            def init_path(self, p, **kwargs):
                self.fs, _ = storage.filesystem(str(p))
                return p

        handle.fs = StorageFileSystem()
        handle.path = handle.fs.init_path(path)
    return handle


def read_metadata(path: str):
    """DCP's index of a checkpoint: every saved key with its size, dtype and shards."""
    try:
        return _dcp_storage(path, write=False).read_metadata()
    except storage.StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing or damaged .metadata, any backend
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(e).__name__}: {e})") from e


def load_full_state(path: str) -> dict[str, Any]:
    """The whole checkpoint as plain, unsharded tensors in this one process (no process
    group): for inspection, tests and export. Keys are DCP's flattened FQNs."""
    # What torch's dcp_to_torch_save does: an empty state dict that the planner fills from
    # the checkpoint's own index (the public load() fills only keys it is given).
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=_dcp_storage(path, write=False), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    flat, _ = flatten_state_dict(state)
    return flat


# -- Preemption -----------------------------------------------------------------------


class Preemption:
    """SIGTERM -> finish the current step, agree on every rank, save, exit EXIT_PREEMPTED.

    The handler only sets ``requested``; the loop checks it between batches (together with
    the batch-count agreement, one small all-reduce, see ``train.agreed_batches``) and sets
    ``stop`` on every rank at the same step. Every rank then saves (where checkpoints are
    on) and exits with ``launch.EXIT_PREEMPTED``, never 0: the run is not finished, and a
    controller must start it again to resume (docs/checkpoints.md, "Preemption").
    """

    def __init__(self, checkpoints: bool = True) -> None:
        self.requested = False  # this process received SIGTERM
        self.stop = False  # every rank agreed to stop
        self.checkpoints = checkpoints
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            then = (
                "saving a checkpoint"
                if self.checkpoints
                else "stopping (no --checkpoint_path: nothing is saved, a restart begins at step 0)"
            )
            print(
                f"rank {os.environ.get('RANK', '0')}: SIGTERM received; finishing the current step and {then}",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


# -- The checkpointer the loop uses ---------------------------------------------------


def _one_line(text: str, limit: int = 600) -> str:
    """Service errors carry multi-line bodies (XML, JSON); a start-up error is one line."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _agree(env, fn: Callable[[], Any], flag: str) -> Any:
    """Run ``fn`` on rank 0 and hand its result, or its error, to every rank, so a bad
    path fails all ranks at start-up instead of leaving some waiting in a collective."""
    from torchrec_cloud import comm

    box: list[Any] = [None]
    if env.rank == 0:
        try:
            box[0] = ("ok", fn())
        except ConfigError as e:
            box[0] = ("config", e.flag, str(e).split(": ", 1)[-1])
        except storage.StorageError as e:
            box[0] = ("config", flag, _one_line(str(e)))
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks too
            box[0] = ("error", f"{type(e).__name__}: {e}")
    result = comm.broadcast_object(box[0], src=0)
    if result[0] == "config":
        raise ConfigError(result[1], result[2])
    if result[0] == "error":
        raise CheckpointError(f"rank 0 could not find the checkpoint to resume: {result[1]}")
    return result[1]


@dataclasses.dataclass
class _PendingSave:
    future: Future
    path: str
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

    def __init__(self, cfg: JobConfig, env, sink) -> None:
        from torchrec_cloud import comm

        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.env = env
        self.sink = sink
        self.root = self.ck.checkpoint_path
        self._last_step: Optional[int] = None
        self._pending: Optional[_PendingSave] = None
        self._async_group = None
        if self.root is not None:
            self._check_writable()
        self.resume_target: Optional[CheckpointInfo] = _agree(env, self._find_resume_target, "checkpoint_path")
        if self.resume_target is not None:
            self._check_compatible(self.resume_target)
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
            return newest_complete(self.root)
        return None

    def _check_compatible(self, info: CheckpointInfo) -> None:
        saved = (info.commit or {}).get("config", {}).get("model")
        current = dataclasses.asdict(self.cfg.model)
        if saved is None or saved == current:
            return
        diffs = ", ".join(
            f"--{k} {saved.get(k)} (saved) vs {current.get(k)} (now)"
            for k in sorted(current)
            if saved.get(k) != current.get(k)
        )
        flag = "resume_from" if self.ck.resume_from else "checkpoint_path"
        raise ConfigError(flag, f"{info.path} was written for a different model: {diffs}")

    # -- resume

    def load(self, dmp: torch.nn.Module, optimizer: Any, scheduler: Any) -> Position:
        """Load the resume target into the sharded model, optimizers and schedule, in place;
        tables are resharded when the number of ranks changed. Returns where to continue."""
        from torch.distributed.checkpoint import load

        info = self.resume_target
        assert info is not None and info.commit is not None
        reader = _dcp_storage(info.path, write=False)
        metadata = reader.read_metadata()
        rng_key = f"rng.rank_{self.env.rank}.torch"
        state = training_state(dmp, optimizer, self.env.rank, with_rng=rng_key in metadata.state_dict_metadata)
        try:
            load(state, storage_reader=reader)
        except Exception as e:
            raise CheckpointError(f"cannot load checkpoint {info.path}: {e}") from e
        dmp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        trainer = info.commit["trainer"]
        scheduler.load_state_dict(trainer["scheduler"])
        if "rng" in state:
            _set_rng_state(state["rng"][f"rank_{self.env.rank}"])
        self._last_step = int(trainer["step"]) if self._is_ours(info) else None
        return Position(int(trainer["step"]), int(trainer["epoch"]), int(trainer["batch"]))

    def _is_ours(self, info: CheckpointInfo) -> bool:
        """Whether ``info`` lives under --checkpoint_path (then it need not be saved again)."""
        if self.root is None:
            return False
        ours = storage.join(self.root, info.name)
        if storage.is_url(ours):
            return info.path.rstrip("/") == ours.rstrip("/")
        return os.path.realpath(info.path) == os.path.realpath(ours)

    # -- save

    def due(self, step: int) -> bool:
        every = self.ck.checkpoint_interval
        return self.enabled and bool(every) and step % every == 0

    def save(self, position: Position, dmp: torch.nn.Module, optimizer: Any, scheduler: Any, reason: str = "interval") -> None:
        """Write a checkpoint of ``position`` (every rank calls this at the same step, with
        no batch in flight). Sync: returns once it is committed. Async: returns once the
        state is copied; the commit happens when the background write finishes."""
        if not self.enabled or position.step == self._last_step:
            return
        self.wait()  # the previous background save commits first (its stall counts the wait)
        from torch.distributed.checkpoint import async_save, save

        from torchrec_cloud import comm

        start = time.perf_counter()
        path = storage.join(self.root, checkpoint_name(position.step))
        if self.env.is_main and storage.exists(path):
            storage.remove(path, recursive=True)  # leftovers of a save that never committed
        comm.barrier()
        trainer = {
            "step": position.step,
            "epoch": position.epoch,
            "batch": position.batch,
            "scheduler": scheduler.state_dict(),
        }
        state = training_state(dmp, optimizer, self.env.rank)
        writer = _dcp_storage(path, write=True)
        self._last_step = position.step
        try:
            if self._async_group is not None:
                future = async_save(
                    _private_copy(state),
                    storage_writer=writer,
                    process_group=self._async_group,
                    async_stager=_already_staged(),
                )
                self._pending = _PendingSave(future, path, trainer, start, time.perf_counter() - start, reason)
                return
            save(state, storage_writer=writer)
        except storage.StorageError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot save checkpoint {path}: {e}") from e
        comm.barrier()
        seconds = time.perf_counter() - start
        self._commit(path, trainer, seconds, seconds, reason, is_async=False)

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
        # Rank 0 coordinates DCP's save: its future resolves only after every rank's
        # shards and the .metadata index are written, so it may commit without a barrier.
        self._commit(pending.path, pending.trainer, now - pending.start, stall, pending.reason, is_async=True)

    def close(self) -> None:
        self.wait(training_waits=False)  # training is over: waiting for the write stalls no step

    def _commit(self, path: str, trainer: dict, seconds: float, stall: float, reason: str, is_async: bool) -> None:
        if not self.env.is_main:
            return
        files = {
            name: storage.size(storage.join(path, name))
            for name in storage.listdir(path)
            if name != COMMIT_FILE and not name.startswith(".tmp-")
        }
        total = sum(files.values())
        commit = {
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
        }
        storage.write_bytes(storage.join(path, COMMIT_FILE), json.dumps(commit, indent=1).encode())
        deleted = apply_retention(self.root, self.ck.checkpoint_keep)
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


# -- CLI: torchrec-cloud checkpoint ls|inspect PATH ------------------------------------


def _human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def _ls(ns: argparse.Namespace) -> int:
    infos = list_checkpoints(ns.path)
    if ns.json:
        print(json.dumps([_info_dict(i) for i in infos]))
        return 0
    if not infos:
        if not storage.exists(ns.path):
            print(f"torchrec-cloud checkpoint ls: {ns.path} does not exist", file=sys.stderr)
            return 1
        print(f"no checkpoints under {ns.path}")
        return 0
    print(f"{'name':<16} {'step':>9} {'ranks':>5} {'size':>10}  {'created':<25} status")
    for i in infos:
        status = "complete" if i.complete else f"INCOMPLETE: {i.problem}"
        created = (i.commit or {}).get("created", "-")
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<16} {step:>9} {i.world_size or '-':>5} {_human(i.bytes):>10}  {created:<25} {status}")
    return 0


def _info_dict(i: CheckpointInfo) -> dict[str, Any]:
    trainer = (i.commit or {}).get("trainer", {})
    return {
        "path": i.path,
        "name": i.name,
        "step": i.step,
        "complete": i.complete,
        "problem": i.problem or None,
        "world_size": i.world_size,
        "bytes": i.bytes,
        "created": (i.commit or {}).get("created"),
        "epoch": trainer.get("epoch"),
        "batch": trainer.get("batch"),
        "reason": (i.commit or {}).get("reason"),
    }


def _inspect(ns: argparse.Namespace) -> int:
    info = inspect_checkpoint(ns.path)
    out = _info_dict(info)
    if not info.complete and info.commit is None and not storage.exists(storage.join(ns.path, ".metadata")):
        print(f"torchrec-cloud checkpoint inspect: {ns.path}: {info.problem}", file=sys.stderr)
        return 1
    tensors: list[dict[str, Any]] = []
    try:
        metadata = read_metadata(ns.path)
    except CheckpointError as e:
        out["problem"] = out["problem"] or str(e)
    else:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for key, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                tensors.append(
                    {"key": key, "shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", ""),
                     "shards": len(md.chunks)}
                )
    out["tensors"] = tensors
    if ns.json:
        print(json.dumps(out))
        return 0 if info.complete else 1
    for key in ("path", "step", "epoch", "batch", "world_size", "created", "reason"):
        print(f"{key:<11} {out[key]}")
    print(f"{'size':<11} {_human(info.bytes)}" + (f" ({info.bytes} bytes)" if info.bytes is not None else ""))
    print(f"{'status':<11} " + ("complete" if info.complete else f"INCOMPLETE: {info.problem}"))
    if tensors:
        groups: dict[str, int] = {}
        for t in tensors:
            groups[t["key"].split(".", 1)[0]] = groups.get(t["key"].split(".", 1)[0], 0) + 1
        print(f"{'tensors':<11} " + ", ".join(f"{n} {g}" for g, n in groups.items()))
        if ns.verbose:
            for t in tensors:
                print(f"  {t['key']}  {t['dtype']}{t['shape']}  shards={t['shards']}")
    return 0 if info.complete else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoint",
        help="list and inspect checkpoints (local folder or s3://, gs://, az:// URL)",
        description="List the checkpoints under a --checkpoint_path, or inspect one.",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    sub.required = True
    ls = sub.add_parser("ls", help="checkpoints under PATH: step, ranks, size, complete or not")
    ls.add_argument("path", metavar="PATH")
    ls.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    ls.set_defaults(func=_run_cli(_ls))
    insp = sub.add_parser("inspect", help="one checkpoint: position, ranks, size, tensors")
    insp.add_argument("path", metavar="PATH")
    insp.add_argument("--json", action="store_true", help="one JSON object instead of text")
    insp.add_argument("-v", "--verbose", action="store_true", help="list every tensor")
    insp.set_defaults(func=_run_cli(_inspect))
    return parser


def _run_cli(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        try:
            return fn(ns)
        except (storage.StorageError, CheckpointError) as e:
            print(f"torchrec-cloud checkpoint {ns.action}: error: {e}", file=sys.stderr)
            return 1

    return run
