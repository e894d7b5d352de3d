"""SIGTERM -> finish the step, agree on every rank, save a checkpoint, exit EXIT_PREEMPTED.

What Kubernetes and the clouds send before a spot or preemptible node goes away is SIGTERM,
with a grace period. The trainer turns it into a flag that the loop reads between batches::

    preemption = Preemption(checkpoints=checkpoints.enabled)
    ...                       # train.agreed_batches sets preemption.stop on every rank
    preemption.close()        # SIGTERM's previous handler back
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any


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
