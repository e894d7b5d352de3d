"""SIGTERM -> finish the step, agree on every rank, save a checkpoint, exit.

What Kubernetes and the clouds send before a spot or preemptible node goes away is SIGTERM,
with a grace period. The trainer turns it into a flag that the loop reads between batches::

    preemption = Preemption(enabled=checkpoints.enabled)
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
    """SIGTERM -> finish the current step, agree on every rank, save, exit 0.

    The handler only sets ``requested``; the loop checks it between batches (together with
    the batch-count agreement, one small all-reduce, see ``train.agreed_batches``) and sets
    ``stop`` on every rank at the same step. Installed only when checkpoints are on;
    without them SIGTERM keeps its default meaning.
    """

    def __init__(self, enabled: bool) -> None:
        self.requested = False
        self.stop = False
        self._previous: Any = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            print(
                f"rank {os.environ.get('RANK', '0')}: SIGTERM received; finishing the current step "
                "and saving a checkpoint",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
