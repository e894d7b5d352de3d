"""``serve --workers N``: N worker processes answering on one host:port, and the parent that
supervises them::

    torchrec-cloud serve models/ev --name ev --port 8080 --workers 2

The parent binds the listening socket and starts each worker as ``torchrec-cloud serve ...
--workers 1`` with that socket inherited (``_TORCHREC_CLOUD_SERVE_WORKER`` in its environment
says which descriptor, and where to report). Each worker is a whole server (its own event
loop, batcher, follower of ``ROOT/current``, SIGTERM drain); the parent scores nothing. Why one
inherited socket rather than ``SO_REUSEPORT``: the workers take connections from one accept
queue, so a worker that stops accepting (a drain, a crash) strands none; with ``SO_REUSEPORT``
the kernel hashes each connection to one socket's own queue, and those queued behind a closing
socket are reset. It also binds once: an address in use is refused before any worker starts.

- **Ready**: a worker writes one byte on its pipe once its model is loaded; when every worker
  has, the parent creates ``ready`` in the server's private folder, and a worker answers ready
  only while that file exists (and it is not draining), so a probe that reaches any worker
  says whether the whole server is.
- **A worker that dies**: one that dies before it was ready ends the server (exit 1): its model
  would not load again either, and a restart loop would hide that. One that dies after is
  reported and replaced; the replacement loads the model before it accepts a connection, so
  the others answer meanwhile and the server stays ready.
- **SIGTERM** (or SIGINT) to the parent: it closes its copy of the socket and sends SIGTERM to
  every worker, each drains as one server does (not ready, what it holds answered); the parent
  exits 0 when every worker did (1 otherwise, or when they outlive ``--grace_s`` by 10 s).
  Workers are sent SIGTERM by the kernel if the parent dies (``PR_SET_PDEATHSIG``).
- **Metrics**: prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` is the
  private folder's ``metrics/``): every worker writes its values there, and ``/metrics`` on any
  worker sums them, so one scrape of the port gives the whole server's counts (gauges: live
  workers' sum, or their largest for the model version).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

from torchrec_cloud.serving import ServingError, write_line

WORKER_ENV = "_TORCHREC_CLOUD_SERVE_WORKER"
READY_FILE = "ready"


@dataclass
class WorkerInfo:
    """What a worker process is told by its parent (the environment's ``WORKER_ENV``)."""

    index: int
    workers: int  # how many the server has
    listen_fd: int
    ready_fd: int
    folder: str
    parent: int
    load_first: bool  # a replacement: load the model before accepting connections

    @staticmethod
    def from_env() -> Optional["WorkerInfo"]:
        text = os.environ.get(WORKER_ENV)
        return WorkerInfo(**json.loads(text)) if text else None

    def server_ready(self) -> bool:
        return os.path.exists(os.path.join(self.folder, READY_FILE))

    def report_ready(self) -> None:
        try:
            os.write(self.ready_fd, b"r")
            os.close(self.ready_fd)
        except OSError:
            pass  # the parent is gone: PR_SET_PDEATHSIG ends this worker

    def follow_parent(self) -> None:
        """SIGTERM when the parent dies, as the parent's own SIGTERM would (Linux)."""
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != self.parent:  # it died before the call
            os.kill(os.getpid(), signal.SIGTERM)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket the workers share (uvicorn's own options: SO_REUSEADDR, backlog 2048)."""
    try:
        [(family, kind, proto, _, address), *_] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                     flags=socket.AI_PASSIVE)  # fmt: skip
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise ServingError(f"could not listen on {host}:{port} ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Starts, watches, replaces and stops the workers (see the module's docstring)."""

    def __init__(self, ns: argparse.Namespace, argv: list[str]) -> None:
        self.ns, self.argv = ns, argv
        self.folder = tempfile.mkdtemp(prefix="torchrec-cloud-serve-")
        self.metrics = os.path.join(self.folder, "metrics")
        os.mkdir(self.metrics)
        self.sock: Optional[socket.socket] = None
        self.procs: dict[int, subprocess.Popen] = {}  # index -> worker
        self.pipes: dict[int, int] = {}  # read end of a worker's ready pipe -> index
        self.ready: set[int] = set()  # workers that reported ready
        self.stopping = 0.0  # when SIGTERM came
        self.signalled = False  # set by the handler, acted on by the loop: a handler that prints could interrupt a print
        self.failed: Optional[str] = None

    def start(self, index: int, load_first: bool) -> None:
        assert self.sock is not None
        read, write = os.pipe()
        info = {"index": index, "workers": self.ns.workers, "listen_fd": self.sock.fileno(), "ready_fd": write,
                "folder": self.folder, "parent": os.getpid(), "load_first": load_first}  # fmt: skip
        env = {**os.environ, WORKER_ENV: json.dumps(info), "PROMETHEUS_MULTIPROC_DIR": self.metrics}
        self.procs[index] = subprocess.Popen([sys.executable, "-m", "torchrec_cloud", *self.argv], env=env,
                                             pass_fds=(self.sock.fileno(), write))  # fmt: skip
        os.close(write)
        self.pipes[read] = index

    def on_signal(self, *_: Any) -> None:
        self.signalled = True

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = time.monotonic()
        log(f"stopping: SIGTERM to {len(self.procs)} worker(s)")
        if self.sock is not None:
            self.sock.close()  # the workers' copies close as they drain; then the port is closed
            self.sock = None
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        ns = self.ns
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        try:
            self.sock = listen(ns.host, ns.port)
            for index in range(ns.workers):
                self.start(index, load_first=False)
            log(f"{ns.workers} workers on http://{ns.host}:{ns.port} (pids "
                f"{', '.join(str(p.pid) for p in self.procs.values())})")  # fmt: skip
            return self.watch()
        finally:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if self.sock is not None:
                self.sock.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def watch(self) -> int:
        from prometheus_client import multiprocess

        codes: list[int] = []
        while self.procs:
            if self.signalled:
                self.stop()
            if self.stopping and time.monotonic() > self.stopping + self.ns.grace_s + 10:
                log(f"{len(self.procs)} worker(s) still running {self.ns.grace_s:g}s after SIGTERM: killed")
                return 1
            readable, _, _ = select.select(list(self.pipes), [], [], 0.2)
            for fd in readable:
                if os.read(fd, 1):
                    self.ready.add(self.pipes[fd])
                    if len(self.ready) == self.ns.workers and not self.server_ready():
                        open(os.path.join(self.folder, READY_FILE), "w").close()
                        log(f"ready: {self.ns.name}, {self.ns.workers} workers")
                os.close(fd)
                del self.pipes[fd]
            for index, proc in list(self.procs.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del self.procs[index]
                multiprocess.mark_process_dead(proc.pid, self.metrics)
                if self.stopping:
                    codes.append(rc)  # a drained worker's: 0
                    continue
                how = f"signal {-rc}" if rc < 0 else f"exit {rc}"
                if index not in self.ready:
                    self.failed = f"worker {index} (pid {proc.pid}) ended ({how}) before its model was loaded"
                    self.stop()
                    continue
                log(f"worker {index} (pid {proc.pid}) died ({how}): starting another")
                self.ready.discard(index)
                self.start(index, load_first=True)
        if self.failed:
            raise ServingError(self.failed + "; its error is above")
        if any(codes):
            log(f"stopped; worker exit statuses {codes}")
            return 1
        log("stopped")
        return 0

    def server_ready(self) -> bool:
        return os.path.exists(os.path.join(self.folder, READY_FILE))


def log(line: str) -> None:
    write_line(f"torchrec-cloud serve: {line}")


def worker_argv(ns: argparse.Namespace, flags: list[str]) -> list[str]:
    """``serve MODEL --flag value ...`` of one worker: the parent's flags, ``--workers 1``."""
    argv = ["serve", ns.model]
    for dest in flags:
        if dest != "workers":
            argv += [f"--{dest}", str(getattr(ns, dest))]
    return argv + ["--workers", "1"]
