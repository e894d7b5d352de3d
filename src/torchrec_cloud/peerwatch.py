"""Lost peers: every pod's launcher beats in the job's rendezvous store and watches the others'.

A pod whose node is reclaimed without notice, powered off or cut from the network sends
nothing: no TCP reset reaches its peers, whose collectives then wait ``--pg_timeout_s``
(30 minutes) and fail, which every controller counts as a crash. A pod that is killed
does send resets, and its peers' collectives fail at once, but then torchrun restarts the
survivors' workers in place, using up ``--max_restarts`` (which never resets) and waiting
in a rendezvous for a pod the controller replaces only later. So ``torchrec-cloud launch``
(:mod:`torchrec_cloud.launch`) runs a :class:`PeerWatch` beside torchrun's agent::

    watch = PeerWatch("pod0:29500", nodes=4, timeout_s=30, describe="node rank 2", on_lost=end_pod)
    watch.start()
    ...                     # torchrun's agent runs the workers
    watch.stop(finished=True)

Every launcher adds 1 to a counter of its own in the rendezvous store every
``timeout_s / 6`` seconds and reads every other launcher's. Once all ``nodes`` have
registered (the group formed), a peer whose counter has not moved for ``timeout_s``
seconds, or a store that has not answered for ``timeout_s`` seconds after it first did
(pod 0, which hosts it, is gone), is a lost peer: ``on_lost`` ends this pod with
``EXIT_PREEMPTED``, so that every surviving pod is started again by its controller
without counting a failure and without spending torchrun's restarts. A launcher that
leaves after a finished run marks its counter ``left:0``, which is never a loss.

Why heartbeats of the launchers, through this store (docs/deploy.md, "Lost nodes"):

- the launcher is the pod's first process and lives as long as the pod, whatever its
  workers do (a long save, an evaluation, a restart): a beat means "this pod is alive",
  not "its step is fast", so the timeout can be short without false alarms, which a
  collective timeout (it must cover the slowest legitimate wait) cannot be;
- the store is where the pods already meet (torchrun's c10d rendezvous, hosted by pod 0's
  launcher): no new port or service, and losing pod 0 shows as the store not answering;
- torchrun's own rendezvous heartbeats only act at the next rendezvous, which a worker
  blocked in a collective never reaches.

Between a peer's death and the verdict (up to ``timeout_s``), the survivors' workers meet the
loss in many ways, and torchrun's agent must not act on any of them. What the agent acts on
(torch 2.13, ``distributed/elastic/agent/server/api.py``, ``SimpleElasticAgent._invoke_run``)
is the result of each ``_monitor_workers`` call: FAILED or UNHEALTHY restarts the worker group
at once (``will restart worker group``, one of ``--max_restarts`` spent, then a rendezvous that
waits for the lost pod); HEALTHY with ``rdzv_handler.num_nodes_waiting() > 0`` (the lost pod's
replacement has joined) restarts it too. A worker's end reaches that result however it
happens, and most ends come before any Python code of ours can wait:

- a collective raises when the dead pod's sockets close: the pipeline's input all-to-all,
  the gradients' all-reduce, evaluation's and the checkpoint's reductions (gloo's
  ``transport/tcp/pair.cc`` read or write error, raised as ``DistBackendError`` or
  ``RuntimeError``); the store's client raises ``DistNetworkError`` when pod 0 is the one
  gone; an error may also reach the top as another type (wrapped by a library, raised by
  a data thread at the next batch);
- a process is ended outside Python: gloo's I/O thread or NCCL's watchdog. torchrun starts
  workers with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (``local_elastic_agent.py``,
  ``_start_workers``), TearDown: "tear down process upon error" (torch 2.13
  ``include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp``, ``ErrorHandlingMode``;
  ``WorkNCCL::handleException`` in ``ProcessGroupNCCL.cpp`` rethrows on the watchdog's
  thread, which aborts the process): SIGABRT, no handler runs;
- the exit path: a worker that handled the error exits non-zero all the same, and the
  agent's process context (``multiprocessing/api.py``, ``_poll``) stops the pod's other
  workers as soon as one has failed.

So the decision is held where it is taken, not where the workers end: the launcher wraps the
agent's ``_monitor_workers`` (:func:`torchrec_cloud.launch._agent_waits_for`), and a result the
agent would restart the workers for waits for this watch's verdict
(``launch._Pod.verdict_before_restart``): a lost peer ends the pod with 200 from the watch's
thread while the agent waits; a beat heard from every peer after the result (every peer pod
alive: the failure is the job's own, or the new pod is an addition) hands the result back and
torchrun restarts the workers as it would have. No worker has to stay alive for it, so every
path above is covered by the same rule; a worker whose collective failed still waits in
:func:`torchrec_cloud.preemption.wait_for_lost_peer` (its log then says why it stopped), but
nothing depends on it. Once the pod is being ended, ``hold_agent`` keeps the agent from
looking at the workers the watch stops.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Callable, Optional

PREFIX = "torchrec-cloud/peers/"
REGISTRY = PREFIX + "registry"
LEFT_FINISHED = b"left:0"


class PeerWatch:
    """The heartbeat of one launcher (module docstring). Two threads: one talks to the store
    (an operation on a frozen store host blocks for good: TCPStore's timeout bounds waits
    for keys, not a request nobody answers), one judges from what the first last heard."""

    def __init__(self, endpoint: str, nodes: int, timeout_s: float, describe: str,
                 on_lost: Callable[[str], None], on_heard: Optional[Callable[[float], None]] = None) -> None:  # fmt: skip
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.endpoint = endpoint
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.on_heard = on_heard
        self.id = uuid.uuid4().hex[:12]
        self.describe = describe
        self.key = PREFIX + self.id
        self.interval_s = max(timeout_s / 6, 0.1)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store = None
        self._last_answer: Optional[float] = None  # when the store last answered; None until it first did
        self._peers: dict[str, str] = {}  # every launcher registered: id -> description
        self._seen: dict[str, tuple[bytes, float]] = {}  # peer -> (its counter, when it last changed)
        # peer -> a time its latest beat came after: the read before the one that saw it change
        # (a change is seen up to one interval after the beat that made it).
        self._beat_after: dict[str, float] = {}
        self._last_read: Optional[float] = None
        self._replaced = False  # the store answering now is not the one the pods met in

    @property
    def formed(self) -> bool:
        """Every launcher of the group has registered: a verdict on each of them can come."""
        with self._lock:
            return len(self._peers) >= self.nodes

    @property
    def reached(self) -> bool:
        """The store has answered at least once (the pods met there)."""
        return self._last_answer is not None

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._beat, name="torchrec-cloud-peer-beat", daemon=True),
                        threading.Thread(target=self._judge, name="torchrec-cloud-peer-watch", daemon=True)]
        for thread in self.threads:
            thread.start()

    def stop(self, finished: bool = False) -> None:
        """Stop watching; after a finished run, tell the peers this pod left on purpose (if
        the store still answers within a second)."""
        self._stop.set()
        store = self._store
        if finished and store is not None:
            done = threading.Thread(target=self._leave, args=(store,), daemon=True)
            done.start()
            done.join(timeout=1.0)

    def _leave(self, store) -> None:
        try:
            store.set(self.key, LEFT_FINISHED)
        except Exception:  # noqa: BLE001 - pod 0 may have left already; nobody is waiting then
            pass

    def _connect(self):
        from torch.distributed import TCPStore

        store = TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=max(self.timeout_s, 1.0)))  # fmt: skip
        if store.add(self.key, 1) == 1 and self._last_answer is not None:
            # A store that never heard of this pod: pod 0 was replaced, the group it hosted
            # is gone. This pod must not join the new one as if it were still in it.
            self._replaced = True
            raise ConnectionError("a new rendezvous store")
        store.append(REGISTRY, f"{self.id}\t{self.describe}\n")
        return store

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                if self._store is None:
                    self._store = self._connect()
                store = self._store
                started = time.monotonic()  # the values read below are from after this
                store.add(self.key, 1)
                peers = _registry(store.get(REGISTRY))
                values = store.multi_get([PREFIX + p for p in peers])
            except Exception:  # noqa: BLE001 - the connection broke: connect again; the judge counts
                self._store = None
                self._stop.wait(self.interval_s)
                continue
            now = time.monotonic()
            with self._lock:
                self._last_answer = now
                self._peers.update(peers)
                for peer, value in zip(peers, values):
                    before = self._seen.get(peer)
                    if before is None or before[0] != value:
                        self._seen[peer] = (value, now)
                        if before is not None and self._last_read is not None:
                            self._beat_after[peer] = self._last_read
                self._last_read = started
            self._stop.wait(self.interval_s)

    def _judge(self) -> None:
        while not self._stop.wait(self.interval_s):
            reason = self._verdict(time.monotonic())
            if reason and not self._stop.is_set():
                self.on_lost(reason)
                return
            heard = self.heard_from_all()
            if heard is not None and self.on_heard is not None:
                self.on_heard(heard)

    def heard_from_all(self) -> Optional[float]:
        """A ``time.monotonic()`` after which every peer of the formed group has beaten (its
        counter changed between a read at or after that time and the next), or None before
        each has been seen to beat. A worker whose collective failed at T waits until this
        passes T (every peer's pod is alive: the failure is the job's own) or a verdict of a
        lost peer: no clock decides it. A change seen after T may come from a beat before T
        (a pod killed just after beating), so the time is that of the read before it."""
        with self._lock:
            if len(self._peers) < self.nodes:
                return None
            live = [peer for peer, (value, _) in self._seen.items() if peer != self.id and value != LEFT_FINISHED]
            if not live or any(peer not in self._beat_after for peer in live):
                return None
            return min(self._beat_after[peer] for peer in live)

    def _verdict(self, now: float) -> Optional[str]:
        with self._lock:
            if self._last_answer is None:
                return None  # not reached yet: torchrun's join timeout governs the rendezvous
            if self._replaced:
                return f"pod 0, which hosted the rendezvous store at {self.endpoint}, was replaced"
            if now - self._last_answer >= self.timeout_s:
                return (f"the rendezvous store at {self.endpoint} (hosted by pod 0) has not answered for "
                        f"{self.timeout_s:g} s")  # fmt: skip
            if len(self._peers) < self.nodes:
                return None  # the group has not formed yet
            for peer, (value, since) in self._seen.items():
                if peer != self.id and value != LEFT_FINISHED and self._last_answer - since >= self.timeout_s:
                    return f"the pod of {self._peers.get(peer, peer)} has sent no heartbeat for {self.timeout_s:g} s"
        return None


def describe_pod(node_rank: Optional[str]) -> str:
    """How a pod is named in the lines its peers print."""
    host = socket.gethostname()
    return f"node rank {node_rank} ({host}, pid {os.getpid()})" if node_rank is not None else f"{host} (pid {os.getpid()})"


def _registry(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in raw.decode(errors="replace").splitlines():
        peer, _, describe = line.partition("\t")
        if peer:
            out[peer] = describe or peer
    return out
