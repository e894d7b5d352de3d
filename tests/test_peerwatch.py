"""The launchers' heartbeats (peerwatch.py) and a failed collective's wait for their verdict
(preemption.wait_for_lost_peer), on a real TCPStore on 127.0.0.1: what ends the wait is
what the launcher heard, never how long a loaded machine took to hear it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
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
