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

What a folder holds is input, not our own writing: ``COMMIT.json`` is checked field by field
(:func:`check_commit`) before anything is read from it. Each checkpoint records the job that
wrote it (``owner``; :func:`recorded_owner`): retention never deletes another job's, nor one
that a reader holds a lease on (:func:`lease`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import sys
import time
import uuid
import warnings
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

from torchrec_cloud import checksum, storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.errors import CommandError
from torchrec_cloud.untrusted import (
    MAX_FILE_BYTES,
    Fields,
    UntrustedInputError,
    check_name,
    integer,
    local_member,
    number,
    read_capped,
    read_json,
    shown,
    text,
)

COMMIT_FILE = "COMMIT.json"
OWNER_FILE = "OWNER.json"
"""Written first into a checkpoint being saved: ``{"owner": job id}`` (COMMIT.json repeats it)."""
OWNER_MAX_CHARS = 128
LEASE_PREFIX = ".lease-"
LEASE_SECONDS = 24 * 3600
"""How long a reader's lease keeps retention off a checkpoint if the reader never removes it."""
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


COMMIT_MAX_BYTES = 64 << 20
"""Largest COMMIT.json read (its checksums take about 21 bytes per 4 MiB of checkpoint)."""
MAX_FILES = 1 << 20


def check_commit(commit: Any, where: str) -> dict[str, Any]:
    """``commit`` (a parsed COMMIT.json) if every field that anything reads has the type and
    range the format allows: file names inside the checkpoint's folder, sizes that add up, one
    checksum per block of each file with a block size that makes sense; else an
    :class:`~torchrec_cloud.untrusted.UntrustedInputError` naming the field. The files' real
    sizes are compared with these by :func:`inspect_checkpoint`."""
    doc = Fields(commit, where)
    doc.int("format", lo=1, hi=FORMAT_VERSION)
    doc.int("step")
    doc.int("world_size", lo=1, hi=1 << 20, optional=True)
    for key in ("created", "reason"):
        doc.text(key, max_len=64, optional=True)
    doc.text("owner", max_len=OWNER_MAX_CHARS, optional=True)
    doc.bool("async", optional=True)
    doc.number("seconds", lo=0, optional=True)
    files = doc.mapping("files", MAX_FILES)
    for name, size in files.items():
        check_name(name, where, "files")
        integer(size, where, f"files.{name}", hi=MAX_FILE_BYTES)
    if COMMIT_FILE in files:
        raise UntrustedInputError(where, "files", f"lists {COMMIT_FILE} itself")
    total = sum(files.values())
    doc.int("bytes", lo=total, hi=total, optional=True)
    trainer = doc.obj("trainer")
    for key in ("step", "epoch", "batch"):
        trainer.int(key)
    scheduler = trainer.obj("scheduler")
    scheduler.int("step_count")
    for i, lr in enumerate(scheduler.list("base_lrs", 1 << 12)):
        number(lr, where, f"trainer.scheduler.base_lrs[{i}]", lo=0)
    config = doc.obj("config") if doc.mapping("config", 64, optional=True) is not None else None
    for key, value in (config.data if config is not None else {}).items():
        if isinstance(value, dict):
            config.mapping(key, 1024)
        else:
            config.text(key, max_len=64, optional=True)
    checksums = doc.obj("checksums", optional=True)
    if checksums is not None:
        checksums.text("algorithm", max_len=32)
        block = checksums.int("block_bytes", lo=1 << 12, hi=1 << 32)
        for name, blocks in checksums.mapping("files", MAX_FILES).items():
            field = f"checksums.files.{shown(name)}"
            if name not in files:
                raise UntrustedInputError(where, field, "names a file that files does not list")
            need = checksum.block_count(files[name], block)
            if not isinstance(blocks, list) or len(blocks) != need:
                raise UntrustedInputError(where, field, f"must list {need} block checksums ({files[name]} bytes in "
                                          f"blocks of {block}), got {shown(blocks)}")  # fmt: skip
            for digest in blocks:
                text(digest, where, field, max_len=64)
    return commit


def inspect_checkpoint(path: str) -> CheckpointInfo:
    """Read one checkpoint folder's commit and check that every file it lists is whole."""
    match = _NAME.match(path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1])
    step = int(match.group(1)) if match else None
    commit_path = storage.join(path, COMMIT_FILE)
    try:
        raw = read_capped(commit_path, COMMIT_MAX_BYTES)
    except UntrustedInputError as e:
        return CheckpointInfo(path, step, False, str(e), damaged=True)
    except storage.StorageNotFoundError:
        present = storage.exists(storage.join(path, ".metadata"))
        problem = (
            f"no {COMMIT_FILE}: the save did not finish on every rank"
            if present or _has_files(path)
            else f"not a checkpoint (no {COMMIT_FILE}, no .metadata)"
        )
        return CheckpointInfo(path, step, False, problem)
    try:
        commit = check_commit(json.loads(raw), COMMIT_FILE)
    except (ValueError, RecursionError) as e:  # not JSON, or not what the format allows
        problem = str(e) if isinstance(e, UntrustedInputError) else f"{COMMIT_FILE} is not valid JSON ({shown(str(e))})"
        return CheckpointInfo(path, step, False, problem, damaged=True)
    step = commit["step"]
    files: dict[str, int] = commit["files"]
    for name, expected in sorted(files.items()):
        file_path = storage.join(path, name)
        try:
            local_member(path, name, COMMIT_FILE, "files")
        except UntrustedInputError as e:
            return CheckpointInfo(path, step, False, str(e), damaged=True)
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


def checkpoints_of(path: str) -> str:
    """The folder of checkpoints PATH means: PATH itself when it holds ``step_N`` folders;
    for a run folder (a ``--output_dir``, with its metrics.jsonl), the ``--checkpoint_path``
    its run wrote to, or its ``ckpt/`` or ``checkpoints/`` folder; else PATH.

    A run folder may come from elsewhere (downloaded with its metrics.jsonl), so the path it
    records is followed only when it is a local path or URL we read, and a line on stderr
    names it whenever it leads out of PATH: the user sees where is read. What is read there
    is checked as any checkpoint is (reading one runs nothing it holds)."""
    from torchrec_cloud.metrics.run_folder import METRICS_FILE, last_run

    candidates = [path]
    recorded = None
    if storage.scheme(path) is None and Path(path, METRICS_FILE).is_file():
        start = (last_run(Path(path)) or ({}, None))[0]
        recorded = _recorded_checkpoint_path(f"{path}/{METRICS_FILE}", start)
        candidates += [recorded] if recorded else []
        candidates += [storage.join(path, "ckpt"), storage.join(path, "checkpoints")]
    chosen = next((c for c in candidates if list_checkpoints(c)), path)
    if chosen == recorded and not _inside(recorded, path):
        print(f"{path} is a run folder whose run wrote its checkpoints to {recorded} (from its "
              f"{METRICS_FILE}): reading them there", file=sys.stderr)  # fmt: skip
    return chosen


def _recorded_checkpoint_path(where: str, start: Any) -> Optional[str]:
    """The ``--checkpoint_path`` a run folder's start record (read from ``where``) names, if it is printable text
    naming a local path or a URL of a scheme we read (anything else is ignored, with a line)."""
    config = start.get("config") if isinstance(start, dict) else None
    section = config.get("checkpoint") if isinstance(config, dict) else None
    written = section.get("checkpoint_path") if isinstance(section, dict) else None
    if written is None:
        return None
    try:
        text(written, where, "config.checkpoint.checkpoint_path", max_len=4096)
        storage.scheme(written)
    except (UntrustedInputError, storage.StorageError):
        print(f"{where} names a --checkpoint_path that is not a path or URL we read "
              f"({shown(written)}): not following it", file=sys.stderr)  # fmt: skip
        return None
    return written


def _inside(target: str, folder: str) -> bool:
    if storage.is_url(target):
        return False
    root = os.path.realpath(folder)
    return os.path.commonpath([root, os.path.realpath(target)]) == root


def resolve(path: str) -> CheckpointInfo:
    """The checkpoint that ``--resume_from PATH`` means: PATH itself, or, for a folder of
    checkpoints or a run folder (:func:`checkpoints_of`), its newest complete one. Anything
    else raises :class:`ConfigError`."""
    info = inspect_checkpoint(path)
    if info.complete:
        return info
    if info.commit is None and not storage.exists(storage.join(path, ".metadata")):
        folder = checkpoints_of(path)
        newest = newest_complete(folder)
        if newest is not None:
            return newest
        listed = list_checkpoints(folder)
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


def recorded_owner(info: CheckpointInfo) -> Optional[str]:
    """The job that wrote ``info`` (``--job_id``): its COMMIT.json's ``owner``, or, for a save
    not committed, its OWNER.json's; None for one written before owners were recorded."""
    if info.commit is not None:
        return info.commit.get("owner")
    marker = storage.join(info.path, OWNER_FILE)
    try:
        return Fields(read_json(marker, 4096), marker).text("owner", max_len=OWNER_MAX_CHARS)
    except (storage.StorageError, UntrustedInputError):
        return None


def write_owner(path: str, owner: str) -> None:
    """Mark the checkpoint folder ``path`` as being written by job ``owner`` (before its files:
    another job's retention then leaves the save alone while it runs)."""
    storage.write_bytes(storage.join(path, OWNER_FILE), json.dumps({"owner": owner}).encode())


@contextlib.contextmanager
def lease(path: str, holder: str) -> Iterator[bool]:
    """While the block runs, retention (:func:`apply_retention`, any job's) does not delete the
    checkpoint ``path``: a ``.lease-*.json`` file in it says who reads it and until when
    (:data:`LEASE_SECONDS`, for a reader that dies without removing it). Yields whether the
    lease was placed: a bucket the reader may not write to refuses it."""
    name = f"{LEASE_PREFIX}{uuid.uuid4().hex[:12]}.json"
    record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "until": time.time() + LEASE_SECONDS}
    held = storage.join(path, name)
    try:
        storage.write_bytes(held, json.dumps(record).encode())
        placed = True
    except storage.StorageError:
        placed = False
    try:
        yield placed
    finally:
        if placed:
            with contextlib.suppress(storage.StorageError):
                storage.remove(held)


def leased(path: str) -> bool:
    """Whether a reader holds a lease on the checkpoint ``path`` that has not expired."""
    try:
        names = [n for n in storage.listdir(path) if n.startswith(LEASE_PREFIX)]
    except storage.StorageError:
        return False
    now = time.time()
    for name in names:
        held = storage.join(path, name)
        try:
            if (Fields(read_json(held, 4096), held).number("until") or 0) > now:
                return True
        except (storage.StorageError, UntrustedInputError):
            continue  # unreadable: no lease
    return False


def apply_retention(root: str, keep: int, owner: Optional[str] = None) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (0 keeps all),
    and incomplete leftovers older than the newest complete one. Returns what was deleted.

    Given ``owner`` (a job id), only that job's checkpoints (and those that record no owner)
    are counted and deleted: another job's never are. A checkpoint a reader holds a lease on
    (:func:`lease`: ``export`` takes one) is left for a later save's retention.
    Works the same on every backend: it only lists, inspects and removes through storage.
    """
    listed = [i for i in list_checkpoints(root) if owner is None or recorded_owner(i) in (None, owner)]
    complete = [i for i in listed if i.complete]
    if not complete:
        return []
    newest_step = complete[-1].step or 0
    doomed = [i for i in listed if not i.complete and (i.step or 0) < newest_step]
    if keep:
        doomed += complete[:-keep]
    doomed = [i for i in doomed if not leased(i.path)]
    for info in doomed:
        storage.remove(info.path, recursive=True)
    return [i.path for i in doomed]
