"""Finding checkpoints in a folder or bucket: which are complete, which to resume, which to delete.

A checkpoint is a ``step_NNNNNNNN`` folder that exists only once its ``COMMIT.json`` is
there and every file it lists has the size it records; anything else is skipped with a
:class:`CheckpointWarning` naming it. ``COMMIT.json`` also records the checksums of every
file (format 2; :mod:`torchrec_cloud.checksum`): :func:`verify_checkpoint` reads every byte
back and names a file whose bytes changed. Everything here goes through
:mod:`torchrec_cloud.storage`, so it works the same on every backend and needs no torch::

    newest_complete("s3://bucket/runs/q")          # the one to resume, or None
    verify_checkpoint("s3://bucket/runs/q/step_00000200").damaged
    apply_retention("s3://bucket/runs/q", keep=3)  # delete all but the newest 3
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from torchrec_cloud import checksum, storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.errors import CommandError

COMMIT_FILE = "COMMIT.json"
FORMAT_VERSION = 2  # of COMMIT.json; 2 added "checksums", 1 recorded sizes only (still read)
_NAME = re.compile(r"^step_(\d+)$")


class CheckpointError(CommandError, RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointDamagedError(CheckpointError):
    """A file of a checkpoint is not what was saved: its bytes differ from the checksums in
    ``COMMIT.json``, or its ``.metadata`` cannot be read."""

    def __init__(self, checkpoint: str, file: str, detail: str) -> None:
        super().__init__(f"{file} of {checkpoint}: {detail}")
        self.checkpoint, self.file, self.detail = checkpoint, file, detail

    def __reduce__(self) -> Any:  # crosses process boundaries (DCP gathers ranks' errors) intact
        return (type(self), (self.checkpoint, self.file, self.detail))


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete or damaged)."""


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint after ``step`` steps; sorts by step."""
    return f"step_{step:08d}"


@dataclasses.dataclass
class CheckpointInfo:
    """One checkpoint folder and whether it is complete (``problem`` says why not)."""

    path: str
    step: Optional[int]
    complete: bool
    problem: str = ""
    commit: Optional[dict[str, Any]] = None
    damaged: bool = False
    """A file's bytes differ from its checksums, or .metadata is unreadable (``problem`` says which)."""

    @property
    def name(self) -> str:
        return self.path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]

    @property
    def world_size(self) -> Optional[int]:
        return self.commit.get("world_size") if self.commit else None

    @property
    def bytes(self) -> Optional[int]:
        return self.commit.get("bytes") if self.commit else None

    @property
    def checksums(self) -> Optional[dict[str, Any]]:
        """``{"algorithm", "block_bytes", "files": {name: [block checksum, ...]}}``; None for a
        checkpoint saved without them (format 1, or ``--no-checkpoint_checksums``)."""
        return self.commit.get("checksums") if self.commit else None

    def as_damaged(self, problem: str) -> "CheckpointInfo":
        return dataclasses.replace(self, complete=False, damaged=True, problem=problem)


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


def verify_checkpoint(path: str, threads: int = 8) -> CheckpointInfo:
    """:func:`inspect_checkpoint`, then every file read back and compared with its checksums
    (files in parallel); a difference makes the result ``damaged``, naming the file and the
    bytes. A checkpoint saved without checksums is returned as inspected (``checksums`` None)."""
    info = inspect_checkpoint(path)
    recorded = info.checksums
    if not info.complete or recorded is None:
        return info
    block = int(recorded["block_bytes"])
    if recorded.get("algorithm") != checksum.ALGORITHM:
        return info.as_damaged(f"{COMMIT_FILE} has checksums of an unknown kind ({recorded.get('algorithm')})")
    names = sorted(info.commit["files"], key=lambda n: -info.commit["files"][n])  # big files first

    def check(name: str) -> Optional[str]:
        expected = recorded["files"].get(name)
        if expected is None:
            return f"{name}: no checksum in {COMMIT_FILE}"
        problem = checksum.first_mismatch(storage.join(path, name), expected, block)
        return f"{name}: {problem}" if problem else None

    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        problems = [p for p in pool.map(check, names) if p]
    return info.as_damaged("; ".join(problems)) if problems else info


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


def newest_complete(
    root: str,
    warn: bool = True,
    check: Optional[Callable[[CheckpointInfo], str]] = None,
    below: Optional[int] = None,
) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint under ``root`` (older than step ``below`` if given);
    newer incomplete ones, and complete ones for which ``check`` returns a problem (damaged),
    are skipped with a :class:`CheckpointWarning` naming them and the checkpoint used instead."""
    try:
        names = storage.listdir(root)
    except storage.StorageNotFoundError:
        return None
    found = sorted(((int(m.group(1)), n) for n in names if (m := _NAME.match(n))), reverse=True)
    skipped: list[CheckpointInfo] = []
    chosen = None
    for step, name in found:
        if below is not None and step >= below:
            continue
        info = inspect_checkpoint(storage.join(root, name))
        problem = check(info) if info.complete and check is not None else ""
        if problem:
            info = info.as_damaged(problem)
        if info.complete:
            chosen = info
            break
        skipped.append(info)
    if warn:
        for info in skipped:
            warn_skipped(info, chosen, stacklevel=3)
    return chosen


def warn_skipped(info: CheckpointInfo, instead: Optional[CheckpointInfo], stacklevel: int = 2) -> None:
    """The warning for a checkpoint that resuming passes over, naming the one used instead."""
    using = f"using {instead.path}" if instead else "no complete checkpoint before it; starting fresh"
    kind = "damaged" if info.damaged else "incomplete"
    warnings.warn(f"skipping {kind} checkpoint {info.path}: {info.problem}; {using}", CheckpointWarning,
                  stacklevel=stacklevel + 1)  # fmt: skip


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
