"""The launchers' heartbeats (peerwatch.py) and a failed collective's wait for their verdict
(preemption.wait_for_lost_peer), on a real TCPStore on 127.0.0.1: what ends the wait is
what the launcher heard, never how long a loaded machine took to hear it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta

import pytest
from checkpoint_runs import LAUNCH, start
from services import free_port
from torch.distributed import TCPStore

from torchrec_cloud import launch, preemption
from torchrec_cloud.peerwatch import PeerWatch


def _until(condition, limit_s: float = 120.0) -> None:
    """Wait for ``condition``; the limit only stops a hang."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield f"127.0.0.1:{master.port}"
    del master


def _watch(endpoint: str, name: str, lost: list, heard: list) -> PeerWatch:
    return PeerWatch(endpoint, nodes=2, timeout_s=1.0, describe=name, on_lost=lost.append, on_heard=heard.append)


def test_live_peers_are_heard_and_a_silent_one_is_lost(store):
    lost_a, heard_a, lost_b, heard_b = [], [], [], []
    a, b = _watch(store, "node rank 0", lost_a, heard_a), _watch(store, "node rank 1", lost_b, heard_b)
    a.start()
    b.start()
    start = time.monotonic()
    # Both beat: each hears the other after it started, and neither is judged lost.
    _until(lambda: heard_a and heard_a[-1] > start and heard_b and heard_b[-1] > start)
    assert lost_a == [] and lost_b == []
    b.stop()  # b's pod is gone: no beat, no goodbye
    for thread in b.threads:
        thread.join()  # its last beat, if one was under way, is done
    gone = time.monotonic()
    # Until the verdict, a never hears b after it went (a change a read sees just after may
    # come from b's last beat before it).
    heard_since = []
    _until(lambda: heard_since.append(a.heard_from_all()) or lost_a)
    assert all(h is None or h < gone for h in heard_since), (gone, heard_since)
    assert lost_a == ["the pod of node rank 1 has sent no heartbeat for 1 s"]
    a.stop()


def test_a_peer_that_left_after_a_finished_run_is_not_lost(store):
    lost_a, heard_a = [], []
    a, b = _watch(store, "node rank 0", lost_a, heard_a), _watch(store, "node rank 1", [], [])
    a.start()
    b.start()
    _until(lambda: heard_a)
    b.stop(finished=True)
    # a hears from nobody any more, yet b's goodbye is never a loss: wait past a's timeout.
    seen = a._seen  # noqa: SLF001 - the counter a read last
    _until(lambda: any(value == b"left:0" for value, _ in seen.values()))
    later = time.monotonic() + 3 * a.timeout_s
    _until(lambda: time.monotonic() > later)
    assert lost_a == []
    a.stop()


def test_a_failed_collective_waits_until_every_peer_is_heard_after_it(tmp_path, monkeypatch):
    """No verdict and no heartbeat yet: the rank waits (however long the launcher takes);
    once the launcher has heard every peer after the failure, it returns (the error is the
    job's own) and the caller raises it."""
    monkeypatch.setenv("TORCHREC_CLOUD_LAUNCHER_DIR", str(tmp_path))
    monkeypatch.setenv(launch.PEER_TIMEOUT_ENV, "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    # A beat heard before the failure says nothing about the peers now.
    (tmp_path / launch._HEARD).write_text(repr(time.monotonic()))
    written = threading.Event()

    def launcher_hears_every_peer() -> None:
        time.sleep(3.0)  # three peer timeouts: the old wait (twice the timeout) gave up by now
        written.set()
        (tmp_path / launch._HEARD).write_text(repr(time.monotonic()))

    threading.Thread(target=launcher_hears_every_peer, daemon=True).start()
    preemption.wait_for_lost_peer(RuntimeError("Gloo connection closed"))  # (the main thread: it sets signals)
    assert written.is_set()


def test_an_error_that_is_not_a_collectives_is_raised_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHREC_CLOUD_LAUNCHER_DIR", str(tmp_path))
    monkeypatch.setenv(launch.PEER_TIMEOUT_ENV, "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    preemption.wait_for_lost_peer(ValueError("a bug of ours"))  # returns: nothing to wait for


# Two pods, two workers each. Node 1's first worker kills its own launcher: the pod is gone,
# with no heartbeat and no goodbye. On node 0 the first worker exits as soon as its launcher
# ends the pod (as a rank waiting in wait_for_lost_peer does); that launcher then says which
# checkpoint the next start resumes from, from a bucket that does not answer (it waits 15 s
# for it). All that while torchrun's agent must not see the worker's exit as the group's
# failure and restart it.
_POD_WORKER = """
import os, signal, sys, time
from torchrec_cloud import launch
node, local, launcher = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]), os.getppid()

def wait(condition):  # until it holds, or this worker's launcher is gone
    while not condition() and os.getppid() == launcher:
        time.sleep(0.05)

launch.report_run("s3://checkpoints/run")
wait(lambda: launch.peers_heard_since() is not None)  # every pod has beaten: the watch is on
if node == 1 and local == 0:
    os.kill(launcher, signal.SIGKILL)
if node == 1 or local == 1:
    wait(lambda: False)
    sys.exit(0)
wait(lambda: launch.pod_ending() is not None)
sys.exit((launch.pod_ending() or (1,))[0])
"""


def test_a_lost_peer_ends_the_pod_without_a_restart_of_its_workers(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_POD_WORKER)
    endpoint = f"127.0.0.1:{free_port()}"
    silent = socket.create_server(("127.0.0.1", 0))  # connections queue; nothing ever answers
    bucket = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "x",
              "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

    def pod(rank: int) -> subprocess.Popen:
        cmd = [*LAUNCH, "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
               "--rdzv_id=lost-peer", "--max_restarts=3", "--monitor_interval=0.1", "--peer_timeout_s=1", str(script)]  # fmt: skip
        return start(cmd, {"TORCHREC_CLOUD_NODE_RANK": str(rank), "LOGLEVEL": "INFO", **bucket})

    pods = [pod(0), pod(1)]
    try:
        log0, _ = pods[0].communicate(timeout=180)
        assert pods[0].returncode == launch.EXIT_PREEMPTED, log0
        assert "the pod of node rank 1 " in log0 and "a peer pod is lost; stopping this pod's workers" in log0, log0
        assert "exit 200: start the pod again; the next start resumes from the newest complete checkpoint under " \
               "s3://checkpoints/run (the storage did not answer in 15 s)" in log0, log0  # fmt: skip
        assert "will restart worker group" not in log0, log0  # no --max_restarts spent, no rendezvous with a lost pod
        assert pods[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        silent.close()
        for p in pods:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
