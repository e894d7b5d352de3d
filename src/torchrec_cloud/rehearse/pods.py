"""Pods as processes: what the kubelet starts for a pod, how it stops it, and how the other
pods reach pod 0.

Each pod's container command runs as a process group of its own with the pod's
environment: downward-API values and the variables the operator sets (``PET_*``), then
Kubernetes' ``$(VAR)`` expansion. What one host changes: each pod's metrics endpoint
moves to a free port on 127.0.0.1, pods run on CPU with gloo, pinned to one core each (pod
i on core i mod cores), and they do not share /dev/shm (``TORCHREC_CLOUD_SHM=0``) as pods on
different nodes cannot. Pod 0 listens on a port of its own (its IP); the other pods reach it
through :class:`PodZeroAddress` (its DNS name), which stops answering while pod 0's node is
lost, as a host that vanished does.
"""

from __future__ import annotations

import dataclasses
import os
import re
import selectors
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.ports import free_port

MARKER = "TORCHREC_CLOUD_REHEARSAL_POD"


@dataclasses.dataclass
class PodTemplate:
    """What the controller starts for one pod: the container and the pod's terminating rules."""

    container: str  # name, for podFailurePolicy's containerName
    command: list[str]
    env: list[dict[str, Any]]  # Kubernetes env entries (value or valueFrom.fieldRef)
    grace_s: float  # terminationGracePeriodSeconds


@dataclasses.dataclass
class Attempt:
    """One pod object: a process group, its log, and what happened to it."""

    index: int
    number: int
    proc: subprocess.Popen
    started: float
    log: Path
    metrics_port: Optional[int]
    marker: bytes  # in the environment of every process of this pod
    progress_mark: int = 0  # train records of the run read before this pod started
    disrupted: bool = False  # the DisruptionTarget condition (preempted, reclaimed, evicted, GC'd)
    deleting: bool = False  # deleted: SIGTERM sent (or, on a lost node, nobody to send it)
    kill_at: Optional[float] = None
    lost: bool = False  # its node is gone: no kubelet reports on it, no container status
    exit_code: Optional[int] = None
    note: str = ""

    @property
    def name(self) -> str:
        return f"pod {self.index} (attempt {self.number})"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``, the
    rest stays as written."""

    def sub(m: re.Match) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def resolve_env(entries: list[dict[str, Any]], metadata: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's env list as the kubelet makes it: values expanded against the ones
    before them, fieldRefs read from the pod's labels and annotations."""
    env: dict[str, str] = {}
    for item in entries:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if not m or m.group(2) not in metadata[m.group(1)]:
            raise ConfigError("launcher", f"the rehearsal cannot resolve the downward-API field {path}")
        env[item["name"]] = metadata[m.group(1)][m.group(2)]
    return env


def local_argv(argv: list[str], endpoint: Optional[str], rendezvous: str) -> tuple[list[str], Optional[int]]:
    """The pod's argv on this host: the rendezvous endpoint on 127.0.0.1, the metrics
    endpoint on free ports of 127.0.0.1 (local rank r serves on the port + r), kept for a
    second after the run (the rehearsal's scrapes, not a collector's interval)."""
    out: list[str] = []
    port = None
    nproc = re.search(r"--nproc_per_node[= ](\d+)", " ".join(argv))
    for i, arg in enumerate(argv):
        if endpoint:
            arg = arg.replace(endpoint, rendezvous)
        previous = argv[i - 1] if i else ""
        if previous == "--prometheus_port":
            port = free_port(max(int(nproc.group(1)), 1) if nproc else 1)
            out += [str(port), "--metrics_host", "127.0.0.1"]
            continue
        out.append("1" if previous == "--prometheus_linger" else arg)
    return out, port


class Pods:
    """Starts and stops the pods' processes, each in its own session, one core each."""

    def __init__(self, folder: Path, base_env: dict[str, str], say: Callable[[str], None]) -> None:
        self.folder = folder
        self.base_env = base_env
        self.say = say
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.counts: dict[int, int] = {}
        self.live: list[Attempt] = []
        self.hold_env: Callable[[int], dict[str, str]] = lambda index: {}  # Faults.hold_env

    def start(self, index: int, template: PodTemplate, metadata: dict[str, dict[str, str]],
              extra_env: dict[str, str], endpoint: Optional[str], rendezvous: str) -> Attempt:  # fmt: skip
        env = {**resolve_env(template.env, metadata), **extra_env, **self.hold_env(index)}
        argv = [expand(a, env) for a in template.command]
        argv, metrics_port = local_argv(argv, endpoint, rendezvous)
        number = self.counts[index] = self.counts.get(index, 0) + 1
        log = self.folder / f"pod-{index}-attempt-{number}.log"
        # torchrun starts each worker in a session of its own, so a pod's processes are found
        # by a variable they all inherit, as a container's are by its cgroup.
        marker = f"{os.getpid()}-{index}-{number}"
        env[MARKER] = marker
        core = {self.cores[index % len(self.cores)]} if self.cores else None

        def pin() -> None:
            if core:
                os.sched_setaffinity(0, core)

        with open(log, "w") as out:
            proc = subprocess.Popen(
                argv, env={**self.base_env, **env}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin,
            )  # fmt: skip
        attempt = Attempt(index, number, proc, time.monotonic(), log, metrics_port, f"{MARKER}={marker}".encode())
        self.live.append(attempt)
        self.say(f"{attempt.name}: started (pid {proc.pid})")
        return attempt

    def terminate(self, attempt: Attempt, grace_s: float, why: str, disrupted: bool = False) -> None:
        """The kubelet's termination: SIGTERM to the container's first process, SIGKILL to
        all of the pod's processes after ``grace_s``. On a lost node nobody runs it: the pod
        is only marked for deletion."""
        if attempt.exit_code is not None or attempt.deleting:
            return
        attempt.deleting, attempt.disrupted = True, attempt.disrupted or disrupted
        attempt.note = attempt.note or why
        if attempt.lost:
            self.say(f"{attempt.name}: {why}: Terminating (its node is gone: nothing stops it)")
            return
        attempt.kill_at = time.monotonic() + grace_s
        self.say(f"{attempt.name}: {why}: SIGTERM (grace {grace_s:g} s)")
        try:
            attempt.proc.send_signal(signal.SIGTERM)  # the container's first process only
        except ProcessLookupError:
            pass

    def kill(self, attempt: Attempt, why: str) -> None:
        attempt.note = attempt.note or why
        self.say(f"{attempt.name}: {why}: SIGKILL to every process of the pod")
        _signal_pod(attempt, signal.SIGKILL)

    def freeze(self, attempt: Attempt, why: str) -> None:
        """The node vanishes: every process of the pod stops where it is, and nothing, not a
        TCP reset, reaches its peers (``PodZeroAddress`` mutes pod 0's name)."""
        attempt.lost, attempt.note = True, why
        self.say(f"{attempt.name}: {why}: SIGSTOP to every process of the pod")
        _signal_pod(attempt, signal.SIGSTOP)

    def reap(self) -> list[Attempt]:
        """Attempts whose process ended since the last call (SIGKILLing those past their grace)."""
        now, ended = time.monotonic(), []
        for attempt in list(self.live):
            code = attempt.proc.poll()
            if code is None:
                if attempt.kill_at is not None and now >= attempt.kill_at:
                    self.kill(attempt, "grace period over")
                    attempt.kill_at = None
                continue
            # The pod's other processes go with its first one, as with a container.
            _signal_pod(attempt, signal.SIGKILL)
            attempt.exit_code = code if code >= 0 else 128 - code
            self.live.remove(attempt)
            ended.append(attempt)
        return ended

    def stop_all(self) -> None:
        for attempt in list(self.live):
            _signal_pod(attempt, signal.SIGKILL)
            attempt.proc.wait()
            attempt.exit_code = attempt.exit_code if attempt.exit_code is not None else 137
        self.live.clear()


def _signal_pod(attempt: Attempt, sig: int) -> None:
    """Send ``sig`` to every process that carries the pod's marker in its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if attempt.marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), sig)
        except (OSError, ProcessLookupError):
            continue
    try:
        attempt.proc.send_signal(sig)
    except ProcessLookupError:
        pass


class PodZeroAddress:
    """Pod 0's DNS name (``<job>-0.<job>``, ``<job>-worker-0``, ``PET_MASTER_ADDR``) as a
    fixed port of 127.0.0.1 forwarding to the port of whichever pod 0 runs now (its IP).

    While there is no pod 0, or it does not listen yet, connections are refused, and
    clients (torchrun's TCPStore) retry. While pod 0's node is lost, its connections carry nothing either way and stay
    open, and new ones are refused: the behaviour of a host that vanished, where a refused
    connection stands in for an unanswered one (both are retried). Without this, a pod
    started while pod 0 is frozen would reach the frozen process itself (the kernel still
    accepts connections for it) and fail once pod 0's processes are killed, which never
    happens to a pod that reached a vanished host.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self._target: Optional[int] = None
        self._listener: Optional[socket.socket] = None
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._muted: list[socket.socket] = []
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="pod-0-address", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def point_to(self, port: Optional[int], vanished: bool = False) -> None:
        """Forward new connections to ``port`` (None: refuse them). ``vanished``: the current
        pod 0's node is lost, its open connections go silent."""
        with self._lock:
            self._target = port
            if vanished:
                for sock in list(self._pairs):
                    self._selector.unregister(sock)
                    self._muted.append(sock)
                self._pairs.clear()
        self._wake_w.send(b"x")

    def close(self) -> None:
        self._running = False
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for sock in [*self._pairs, *self._muted, self._listener, self._wake_r, self._wake_w]:
            if sock is not None:
                sock.close()

    def _sync_listener(self) -> None:
        if self._target is not None and self._listener is None:
            # Answer only once pod 0 does: a connection accepted here and then dropped is
            # an error to torchrun's store client, a refused one a reason to retry.
            try:
                socket.create_connection(("127.0.0.1", self._target), timeout=0.2).close()
            except OSError:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
            self._listener = listener
        elif self._target is None and self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def _serve(self) -> None:
        while self._running:
            with self._lock:
                self._sync_listener()
            for key, _ in self._selector.select(timeout=0.2):
                sock = key.fileobj
                if sock is self._wake_r:
                    self._wake_r.recv(4096)
                elif sock is self._listener:
                    self._accept()
                else:
                    self._pump(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self._target), timeout=2)
        except OSError:  # pod 0 is not listening yet: as if its address were not up
            client.close()
            return
        for a, b in ((client, upstream), (upstream, client)):
            a.setblocking(False)
            self._pairs[a] = b
            self._selector.register(a, selectors.EVENT_READ)

    def _pump(self, sock: socket.socket) -> None:
        other = self._pairs.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if data:
            try:
                other.setblocking(True)
                other.sendall(data)
                other.setblocking(False)
                return
            except OSError:
                pass
        for s in (sock, other):  # one end closed or reset: so does the other, as through a network
            self._pairs.pop(s, None)
            try:
                self._selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
