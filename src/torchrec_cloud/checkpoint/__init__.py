"""Checkpoints that survive preemption: sharded save and load with torch.distributed.checkpoint.

The package, by concept:

- ``checkpointer``: :class:`Checkpointer`, what the training loop saves, resumes and prunes
  with (start-up checks, the commit marker written last, asynchronous saves);
- ``store``: finding checkpoints in a folder or bucket (complete or not, the newest,
  retention); no torch needed;
- ``dcp``: what a checkpoint holds and DCP bound to :mod:`torchrec_cloud.storage`;
- ``cli``: ``torchrec-cloud checkpoint ls|inspect``.

SIGTERM handling lives in :mod:`torchrec_cloud.preemption`.
"""

from torchrec_cloud.checkpoint.checkpointer import Checkpointer, Position
from torchrec_cloud.checkpoint.dcp import load_full_state, read_metadata, training_state
from torchrec_cloud.checkpoint.store import (
    COMMIT_FILE,
    CheckpointError,
    CheckpointInfo,
    CheckpointWarning,
    apply_retention,
    checkpoint_name,
    inspect_checkpoint,
    list_checkpoints,
    newest_complete,
    resolve,
)

__all__ = [
    "COMMIT_FILE",
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
]
