"""However a worker ends after a peer pod dies, the survivor's launcher exits 200 and
torchrun's agent spends no restart (issue #38; the design: ``peerwatch``'s docstring).

Two pods of one worker each, through ``torchrec-cloud launch`` and the real c10d rendezvous
on 127.0.0.1. One pod is killed whole (launcher and worker, SIGKILL: an OOM kill, a node
gone) at a point its peer is waiting on it, so the survivor's worker meets the loss in the
operation named by the case, never by a clock: its collective or store call is blocked on
the dead pod and fails when the dead pod's sockets close. Then the survivor's worker ends
the way the case says, each a way the agent would have counted as a failed group before:

- ``raise``: the error escapes (a type nothing waits for);
- ``train``: as ``torchrec-cloud train`` handles it (wait for the launcher, then raise);
- ``abort``: SIGABRT, as gloo's I/O thread or NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``
  TearDown, which torchrun sets) end a process, outside any Python handler;
- ``replaced``: the survivor's worker notices nothing, but the dead pod's replacement
  joins the rendezvous, which the agent takes as a new node to restart its workers for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from checkpoint_runs import LAUNCH, TINY, check, run, start
from services import free_port

from torchrec_cloud import launch

_WORKER = r"""
import os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torchrec_cloud import launch, preemption

op, end, victim = os.environ["OP"], os.environ["END"], int(os.environ["VICTIM"])
node, launcher = int(os.environ["GROUP_RANK"]), os.getppid()

def wait(condition):  # until it holds, or this worker's launcher is gone
    while not condition() and os.getppid() == launcher:
        time.sleep(0.05)

launch.report_run(os.environ["CHECKPOINTS"])
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
dist.barrier()
wait(lambda: launch.peers_heard_since() is not None)  # every pod has beaten: the watch is on
dist.barrier()  # both pods are past the line above
if node == victim:
    os.kill(launcher, signal.SIGKILL)  # the whole pod goes: its launcher (and store), then this worker
    os.kill(os.getpid(), signal.SIGKILL)
try:
    if op == "all_to_all":  # the pipeline's input all-to-all
        out = torch.empty(2)
        dist.all_to_all_single(out, torch.ones(2))
    elif op == "all_reduce":  # the gradients' all-reduce
        dist.all_reduce(torch.ones(4))
    elif op == "store":  # the rendezvous store's client (pod 0, which hosts it, is the victim)
        dist.distributed_c10d._get_default_store().get("torchrec-cloud/test/never-set")
    elif op == "sleep":
        wait(lambda: launch.pod_ending() is not None)
        sys.exit((launch.pod_ending() or (1,))[0])
    raise SystemExit(f"{op} returned although its peer pod is gone")
except Exception as e:
    print(f"worker: {op} failed: {type(e).__name__}", file=sys.stderr, flush=True)
    if end == "abort":
        os.abort()
    if end == "train":
        preemption.wait_for_lost_peer(e)
    raise
"""

CASES = {
    "all_to_all-raise": ("all_to_all", "raise", 1),
    "all_reduce-train": ("all_reduce", "train", 1),
    "all_reduce-abort": ("all_reduce", "abort", 1),
    "store-raise": ("store", "raise", 0),
    "sleep-replaced": ("sleep", "replaced", 1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A run's checkpoints (steps 10 and 20): what the survivor says the next start resumes from."""
    out = tmp_path_factory.mktemp("checkpoints")
    check(run([sys.executable, "-m", "torchrec_cloud", "train", *TINY, "--output_dir", str(out / "run"),
               "--checkpoint_path", str(out / "ckpt"), "--checkpoint_interval", "10"]))  # fmt: skip
    return str(out / "ckpt")


@pytest.mark.parametrize("case", list(CASES))
def test_however_a_worker_ends_after_a_peer_is_lost_no_restart_is_spent(case, checkpoints, tmp_path):
    op, end, victim = CASES[case]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    endpoint = f"127.0.0.1:{free_port()}"
    survivor = 1 - victim
    # The replacement must reach the rendezvous before the verdict for the agent to see it
    # (a start of python and torch): a longer timeout there, or the case tests nothing.
    timeout_s = 15 if end == "replaced" else 2

    def pod(rank: int) -> subprocess.Popen:
        cmd = [*LAUNCH, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
               "--rdzv_id=paths", "--max_restarts=3", "--monitor_interval=0.1", f"--peer_timeout_s={timeout_s}",
               str(script)]  # fmt: skip
        env = {"TORCHREC_CLOUD_NODE_RANK": str(rank), "LOGLEVEL": "INFO", "OP": op, "END": end,
               "VICTIM": str(victim), "CHECKPOINTS": checkpoints}  # fmt: skip
        return start(cmd, env)

    pods = [pod(0), pod(1)]
    replacement = None
    try:
        assert pods[victim].wait(timeout=180) == -signal.SIGKILL, pods[victim].communicate()[0]
        if end == "replaced":
            # The controller replaces the lost pod at once; it waits in the rendezvous, which
            # the survivor's agent sees as a new node (its healthy workers would be restarted).
            replacement = pod(victim)
        log, _ = pods[survivor].communicate(timeout=180)
        assert pods[survivor].returncode == launch.EXIT_PREEMPTED, log
        # The verdict: the peer watch's; or, pod 0 being gone, the agent's own call to the
        # store it hosted failing first (in a healthy group's look for new nodes).
        assert ("a peer pod is lost; stopping this pod's workers" in log
                or (op == "store" and "the rendezvous store (hosted by pod 0) is gone" in log)), log
        assert "will restart worker group" not in log, log  # no --max_restarts spent, no rendezvous with it
        assert "exit 200: start the pod again; the next start resumes from checkpoint step 20 " in log, log
        if end in ("raise", "abort") and op != "store":  # the worker ended before the verdict: the agent waited
            assert "checking that every peer pod is alive before torchrun restarts the workers" in log, log
    finally:
        for p in (*pods, replacement):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


_STORE_HOST = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
time.sleep(600)
"""


def test_a_pod_that_met_the_previous_pod_0_on_its_way_out_exits_200(tmp_path):
    """The rehearsed kill test, once in 20 runs beside a CPU hog: pod 1's replacement reached
    pod 0's store while pod 0 (the survivor of the first kill) was still ending, and when
    pod 0 exited the replacement's rendezvous failed before its peer watch had heard the
    store: exit 1, a counted failure. Here the store's host is killed once the new pod's
    rendezvous has written its state there; no peer watch at all (--peer_timeout_s=0)."""
    from torch.distributed import TCPStore
    from datetime import timedelta

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST, str(port)], start_new_session=True)
    pod = None
    try:
        client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        pod = start([*LAUNCH, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                     f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=late", "--peer_timeout_s=0",
                     "--rdzv_conf=is_host=0", "-m", "torchrec_cloud", "train"])  # fmt: skip
        client.wait(["torch.rendezvous.late"])  # the pod is in the rendezvous, connected to the store
        os.killpg(host.pid, signal.SIGKILL)
        log, _ = pod.communicate(timeout=120)
        assert pod.returncode == launch.EXIT_PREEMPTED, log
        assert "the rendezvous store (hosted by pod 0) is gone" in log, log
    finally:
        for p in (host, pod):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
