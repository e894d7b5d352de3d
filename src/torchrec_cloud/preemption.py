"""SIGTERM -> finish the step, agree on every rank, save if the grace allows, exit EXIT_PREEMPTED.

What Kubernetes and the clouds send before a spot or preemptible node goes away is SIGTERM,
with a grace period that may be far too short for a save (GKE gives a reclaimed node's pods
15 s): the periodic checkpoints (``--checkpoint_every_s``) are the plan, a save on SIGTERM a
bonus taken only when it fits. The trainer turns SIGTERM into a flag that the loop reads
between batches::

    preemption = Preemption(checkpoints=checkpoints.enabled, grace_s=cfg.train.sigterm_grace_s)
    ...                       # train.agreed_batches sets preemption.stop on every rank
    vote = preemption.save_fits(estimate_s)   # all ranks agree: save, or stop at once
    preemption.close()        # SIGTERM's previous handler back

Under ``torchrec-cloud launch`` a watchdog thread also obeys the launcher at once when it
ends the pod for a lost peer, and :func:`wait_for_lost_peer` keeps a rank whose collective
failed from exiting (and using up torchrun's restarts) before the launcher has checked
whether a peer pod is gone.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
import time
from typing import Any, Optional

from torchrec_cloud.launch import (
    EXIT_PREEMPTED,
    LOST_PEER,
    PEER_TIMEOUT_ENV,
    VERDICT_CAP_S,
    peers_heard_since,
    pod_ending,
)

# A save on SIGTERM must finish this much sooner than the grace: the estimate is one past
# save's time, and after the save the ranks still meet once and the processes exit.
SAVE_MARGIN = 1.25
TEARDOWN_S = 2.0
# Set by `torchrec-cloud rehearse` on the pod a fault is set for: its ranks wait after this
# step until the fault comes, so that the fault lands at the step it names on any machine.
REHEARSAL_HOLD_ENV = "TORCHREC_CLOUD_REHEARSAL_HOLD_AT_STEP"
REHEARSAL_HOLD_MAX_S = 120.0


class Preemption:
    """SIGTERM -> finish the current step, agree on every rank, save if it fits, exit
    EXIT_PREEMPTED.

    The handler only sets ``requested``; the loop checks it between batches (together with
    the batch-count agreement, one small all-reduce, see ``train.agreed_batches``) and sets
    ``stop`` on every rank at the same step. The ranks then agree whether a save fits in
    what is left of the grace (:meth:`save_fits`), and every process exits with
    ``launch.EXIT_PREEMPTED``, never 0: the run is not finished, and a controller must
    start it again to resume (docs/checkpoints.md, "Preemption").
    """

    def __init__(self, checkpoints: bool = True, stall_s: float = 0.0, grace_s: Optional[float] = None) -> None:
        self.requested = False  # this process received SIGTERM
        self.stop = False  # every rank agreed to stop
        self.checkpoints = checkpoints
        self.stall_s = stall_s
        self.grace_s = grace_s
        self.sigterm_at: Optional[float] = None  # time.monotonic() of the first SIGTERM
        self._training = False
        self._last_beat = time.monotonic()
        self._previous: Any = None
        self._wakeup: Any = None
        self._hold_at = int(os.environ.get(REHEARSAL_HOLD_ENV) or 0) or None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            if stall_s or _under_launcher():
                self._start_watchdog()

    def training(self, on: bool) -> None:
        """The loop is (or is no longer) stepping through a segment's batches: the only time
        a stop is always at most one step away (evaluation and saves happen between)."""
        self._training = on
        self._last_beat = time.monotonic()

    def beat(self) -> None:
        """A training step finished (the loop fetched the next batch)."""
        self._last_beat = time.monotonic()

    def reached(self, step: int) -> None:
        """The loop finished ``step`` (and logged it). In a rehearsal, the first time it is
        at or past the step a fault is set for, wait there for the fault: SIGTERM (a drain,
        reclaim or eviction) ends the wait; a kill or a lost node never returns."""
        if self._hold_at is None or step < self._hold_at:
            return
        self._hold_at = None
        until = time.monotonic() + REHEARSAL_HOLD_MAX_S
        while not self.requested and time.monotonic() < until:
            time.sleep(0.01)
        if not self.requested:
            print(f"rank {_rank()}: no fault came in {REHEARSAL_HOLD_MAX_S:g} s at step {step} "
                  f"({REHEARSAL_HOLD_ENV}); training on", file=sys.stderr, flush=True)  # fmt: skip

    def _handle(self, signum, frame) -> None:
        self._note_sigterm()
        if not self.requested:
            if not self.checkpoints:
                then = "stopping (no --checkpoint_path: nothing is saved, a restart begins at step 0)"
            elif self.grace_s is not None:
                then = f"saving a checkpoint if one fits in the {self.grace_s:g} s grace (--sigterm_grace_s)"
            else:
                then = "saving a checkpoint"
            print(f"rank {_rank()}: SIGTERM received; finishing the current step, then {then}", file=sys.stderr,
                  flush=True)  # fmt: skip
        self.requested = True

    def _note_sigterm(self) -> None:
        if self.sigterm_at is None:
            self.sigterm_at = time.monotonic()

    def time_left(self) -> Optional[float]:
        """Seconds of the grace left before the SIGKILL; None when unknown (no grace given,
        or no SIGTERM received by this process)."""
        if self.grace_s is None or self.sigterm_at is None:
            return None
        return self.grace_s - (time.monotonic() - self.sigterm_at)

    def save_fits(self, estimate_s: Optional[float]) -> bool:
        """This rank's vote on saving now that every rank stopped: yes when this process got
        no SIGTERM or no grace is known, or when a save of ``estimate_s`` seconds (the last
        one's measured time; None: never measured, nothing to lose) fits in what is left of
        the grace with a margin (``SAVE_MARGIN``, ``TEARDOWN_S``)."""
        left = self.time_left()
        if left is None or estimate_s is None:
            return True
        return estimate_s * SAVE_MARGIN + TEARDOWN_S <= left

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
        while True:
            waiting = bool(self.stall_s and self.requested and not self.stop)
            ready, _, _ = select.select([read_fd], [], [], min(1.0, self.stall_s / 10) if waiting else None)
            if ready:
                data = os.read(read_fd, 64)
                if not data:  # the write end is closed: training is over
                    os.close(read_fd)
                    return
                if signal.SIGTERM in data:
                    self._note_sigterm()
                    _obey_launcher()
                    self.requested = True
            if waiting and self._training and time.monotonic() - self._last_beat > self.stall_s:
                print(
                    f"rank {_rank()}: SIGTERM received, but no training step has finished "
                    f"for {self.stall_s:g} s (a peer lost or frozen?): exiting without a checkpoint; a restart "
                    f"resumes from the last complete one (--stop_stall_s)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_PREEMPTED)

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._wakeup is not None:
            read_fd, write_fd, previous_fd = self._wakeup
            signal.set_wakeup_fd(previous_fd)
            os.close(write_fd)  # the watchdog's read returns empty: it stops waiting
            self._wakeup = None


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _under_launcher() -> bool:
    return bool(os.environ.get("TORCHREC_CLOUD_LAUNCHER_DIR"))


def _obey_launcher() -> None:
    """Exit at once when the launcher ended the pod for a lost peer: the run cannot go on,
    and this rank may be blocked in a collective that never returns."""
    ending = pod_ending()
    if ending is not None and ending[1].startswith(LOST_PEER):
        print(f"rank {_rank()}: stopping: {ending[1]}", file=sys.stderr, flush=True)
        os._exit(ending[0])


_COLLECTIVE_ERROR = re.compile(r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out", re.IGNORECASE)


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` came from a collective or the store (a peer's failure shows here)."""
    import torch.distributed as dist

    if isinstance(error, (dist.DistError, ConnectionError)):
        return True
    return isinstance(error, (RuntimeError, OSError)) and bool(_COLLECTIVE_ERROR.search(str(error)))


def wait_for_lost_peer(error: BaseException) -> None:
    """A collective failed on this rank. Under ``torchrec-cloud launch`` with peer pods, the
    failure may be a peer pod's loss, which the launcher detects from its heartbeats within
    about ``--peer_timeout_s``: wait for its verdict before the error ends this worker, which
    torchrun would restart in place, using up ``--max_restarts``. Returns (the error is this
    job's own: raise it) once the launcher has heard every peer pod beat after the failure:
    what ends the wait is what the launcher heard, not how long it took a loaded machine to
    hear it. ``launch.VERDICT_CAP_S`` only stops a hang of the launcher itself."""
    timeout = float(os.environ.get(PEER_TIMEOUT_ENV) or 0)
    if not _under_launcher() or timeout <= 0 or int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return
    if not is_collective_error(error):
        return
    failed_at = time.monotonic()
    text = " ".join(str(error).split())[:200]
    print(f"rank {_rank()}: a collective failed ({text}); waiting for the launcher to check whether a peer pod "
          "is lost", file=sys.stderr, flush=True)  # fmt: skip
    signal.signal(signal.SIGTERM, lambda signum, frame: _obey_launcher() or os._exit(EXIT_PREEMPTED))
    deadline = failed_at + max(VERDICT_CAP_S, 10 * timeout)
    while time.monotonic() < deadline:
        _obey_launcher()
        heard = peers_heard_since()
        if heard is not None and heard > failed_at:
            print(f"rank {_rank()}: every peer pod is alive: the failure is this job's own", file=sys.stderr,
                  flush=True)  # fmt: skip
            break
        time.sleep(0.2)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
