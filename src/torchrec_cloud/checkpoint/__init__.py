"""Checkpoints that survive preemption: sharded save and load with torch.distributed.checkpoint.

The package, by concept:

- ``checkpointer``: :class:`Checkpointer`, what the training loop saves, resumes and prunes
  with (start-up checks, the commit marker written last, asynchronous saves);
- ``store``: finding checkpoints in a folder or bucket (complete or not, the newest,
  retention, every byte checked against its checksums); no torch needed;
- ``dcp``: what a checkpoint holds and DCP bound to :mod:`torchrec_cloud.storage`, each file
  hashed as written and verified as read;
- ``cli``: ``torchrec-cloud checkpoint ls|inspect|verify``.

SIGTERM handling lives in :mod:`torchrec_cloud.preemption`.
"""

from torchrec_cloud.checkpoint.checkpointer import Checkpointer, Position
from torchrec_cloud.checkpoint.dcp import load_full_state, read_metadata, training_state, verify
from torchrec_cloud.checkpoint.store import (
    COMMIT_FILE,
    CheckpointDamagedError,
    CheckpointError,
    CheckpointInfo,
    CheckpointWarning,
    apply_retention,
    checkpoint_name,
    inspect_checkpoint,
    list_checkpoints,
    newest_complete,
    resolve,
    verify_checkpoint,
)

__all__ = [
    "COMMIT_FILE",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWarning",
    "Checkpointer",
    "Position",
    "apply_retention",
    "checkpoint_name",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_full_state",
    "newest_complete",
    "read_metadata",
    "resolve",
    "training_state",
    "verify",
    "verify_checkpoint",
]
