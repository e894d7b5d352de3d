"""The starts a checkpoint folder records (``attempts.jsonl``): what the restart budget
(``--no_progress_restarts``) counts, read back as untrusted input."""

from __future__ import annotations

import json
import warnings
from typing import Any

from torchrec_cloud import storage
from torchrec_cloud.checkpoint.store import CheckpointWarning
from torchrec_cloud.config import JOB_ID
from torchrec_cloud.untrusted import shown

ATTEMPTS_FILE = "attempts.jsonl"  # beside the checkpoints: one line per start
_KEEP_ATTEMPTS = 100
_ATTEMPT_LINE_BYTES = 4096  # a line we write is about 100 bytes


def read_attempts(root: str) -> list[dict[str, Any]]:
    """The starts ``root``'s ``attempts.jsonl`` records, oldest first, each checked field by field.

    The file lies in the checkpoint bucket, which others may write: it is read as untrusted
    input (at most :data:`_KEEP_ATTEMPTS` lines of :data:`_ATTEMPT_LINE_BYTES`, typed fields).
    A line that is not a start as we write it is left out with one warning naming the file,
    the line and the field, and the rewrite drops it: the file only counts restarts, so a
    damaged one costs at most a few more restarts of a loop, where refusing to start (exit 2,
    for good) would let it stop a healthy job. A file too large to be ours is ignored whole."""
    import io

    from torchrec_cloud.untrusted import Fields, UntrustedInputError, capped_lines, local_member, read_capped

    def ignored(where: str, problem: str) -> None:
        warnings.warn(f"{where}: {problem}; the restart budget (--no_progress_restarts) does without it",
                      CheckpointWarning, stacklevel=3)  # fmt: skip

    path = storage.join(root, ATTEMPTS_FILE)
    try:
        local_member(root, ATTEMPTS_FILE, path, "")
        data = read_capped(path, _KEEP_ATTEMPTS * _ATTEMPT_LINE_BYTES)
    except storage.StorageNotFoundError:
        return []
    except UntrustedInputError as e:
        ignored(str(e), "not a record of starts")
        return []
    kept: list[dict[str, Any]] = []
    for number, line in enumerate(capped_lines(io.BytesIO(data), _ATTEMPT_LINE_BYTES), 1):
        where = f"{path}:{number}"
        try:
            if line is None:
                raise UntrustedInputError(where, "", f"is longer than {_ATTEMPT_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                raise UntrustedInputError(where, "", "is not a JSON object") from None
            fields = Fields(record, where)
            entry: dict[str, Any] = {"resumed_from": fields.int("resumed_from")}
            entry["time"] = fields.text("time", max_len=40, optional=True)
            entry["world_size"] = fields.int("world_size", lo=1, hi=1 << 20, optional=True)
            job = fields.text("job", max_len=128, optional=True)
            if job is not None and not JOB_ID.fullmatch(job):
                raise UntrustedInputError(where, "job", f"must be a job id (--job_id), got {shown(job)}")
            entry["job"] = job
        except UntrustedInputError as e:
            ignored(str(e), "line left out")
            continue
        kept.append({k: v for k, v in entry.items() if v is not None})
    return kept
