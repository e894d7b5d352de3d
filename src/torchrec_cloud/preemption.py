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
import time
from typing import Any


class Preemption:
    """SIGTERM -> finish the current step, agree on every rank, save, exit EXIT_PREEMPTED.

    The handler only sets ``requested``; the loop checks it between batches (together with
    the batch-count agreement, one small all-reduce, see ``train.agreed_batches``) and sets
    ``stop`` on every rank at the same step. Every rank then saves (where checkpoints are
    on) and exits with ``launch.EXIT_PREEMPTED``, never 0: the run is not finished, and a
    controller must start it again to resume (docs/checkpoints.md, "Preemption").
    """

    def __init__(self, checkpoints: bool = True, stall_s: float = 0.0) -> None:
        self.requested = False  # this process received SIGTERM
        self.stop = False  # every rank agreed to stop
        self.checkpoints = checkpoints
        self.stall_s = stall_s
        self._training = False
        self._last_beat = time.monotonic()
        self._previous: Any = None
        self._wakeup: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            if stall_s:
                self._start_watchdog()

    def training(self, on: bool) -> None:
        """The loop is (or is no longer) stepping through a segment's batches: the only time
        a stop is always at most one step away (evaluation and saves happen between)."""
        self._training = on
        self._last_beat = time.monotonic()

    def beat(self) -> None:
        """A training step finished (the loop fetched the next batch)."""
        self._last_beat = time.monotonic()

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

    def _start_watchdog(self) -> None:
        """A rank blocked in a collective with a lost or frozen peer never reaches the
        agreement to stop, and its Python handler above does not even run until the
        collective returns (CPython runs handlers between bytecodes of the main thread).
        Without this, the launcher waits its whole shutdown timeout (sized for a save)
        before it can restart the group. The C-level handler also writes the signal's
        number to a pipe, which this thread reads whatever the main thread is doing."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._wakeup = (read_fd, write_fd, signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))
        threading.Thread(target=self._watch, args=(read_fd,), name="preemption-watchdog", daemon=True).start()

    def _watch(self, read_fd: int) -> None:
        from torchrec_cloud.launch import EXIT_PREEMPTED

        while True:
            data = os.read(read_fd, 64)
            if not data:  # closed: training is over
                os.close(read_fd)
                return
            if signal.SIGTERM in data:
                break
        # read_fd stays open while the handler may still write to it (a write to a pipe
        # without a reader makes CPython print an error for each later signal)
        self.requested = True
        while not self.stop and self._wakeup is not None:
            time.sleep(min(1.0, self.stall_s / 10))
            if self._training and not self.stop and time.monotonic() - self._last_beat > self.stall_s:
                print(
                    f"rank {os.environ.get('RANK', '0')}: SIGTERM received, but no training step has finished "
                    f"for {self.stall_s:g} s (a peer lost or frozen?): exiting without a checkpoint; a restart "
                    f"resumes from the last complete one (--stop_stall_s)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_PREEMPTED)
        os.close(read_fd)

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._wakeup is not None:
            read_fd, write_fd, previous_fd = self._wakeup
            signal.set_wakeup_fd(previous_fd)
            os.close(write_fd)  # the watchdog's read returns empty: it stops waiting
            self._wakeup = None


def shield_data_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn`` (``--data_workers``): keep a rank's data worker processes
    out of the SIGTERM meant for the rank, so the rank can finish its step and save.

    torchrun's agent stops a rank by sending SIGTERM to the rank's whole process group
    (torch 2.13 ``distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py``,
    ``SubprocessHandler.close``: ``os.killpg``). DataLoader workers are forked into that
    group, and the SIGTERM handler torch gives them (``torch/csrc/DataLoader.cpp``,
    ``handler_SIGTERM``) exits quietly only for a SIGTERM from the worker's parent: anyone
    else's kills it. The rank's SIGCHLD handler then raises at its next batch, and the rank
    dies without a checkpoint. In a process group of its own the worker is not reached; the
    rank stops at the end of its step, saves, and shuts its workers down as at the end of an
    epoch (its SIGTERM to them still ends them quietly). A worker whose rank died exits by
    itself: DataLoader's worker loop watches for its parent.

    A forked worker also inherits the rank's signal wakeup pipe (the preemption watchdog
    reads it); a signal to the worker must not read there as the rank's own SIGTERM.
    """
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
