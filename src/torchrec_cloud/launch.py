"""``torchrec-cloud launch``: torchrun for pods, with exit codes a controller can act on.

    torchrec-cloud launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 --rdzv_id=myjob -m torchrec_cloud train --preset criteo-1tb

It takes torchrun's flags, and the ``PET_*`` variables the Kubeflow operators set, unchanged,
and runs torchrun's elastic agent in this process. What it adds is the pod's exit code,
which is what Kubernetes acts on (a Job's podFailurePolicy, PyTorchJob's ExitCode restart
policy, a JobSet's failure policy)::

    0    the workers reported the run finished: the only way a pod of this job exits 0
    2    the workers refused their flags or configuration, or gave up (no progress in
         --no_progress_restarts starts): a retry cannot help
    200  EXIT_PREEMPTED: start the pod again: the run stopped for a preemption (this pod's
         SIGTERM, or a peer pod's), or a peer pod was lost (no heartbeat for
         --peer_timeout_s); one line names the checkpoint step the next start resumes from
    1    anything else: a worker failed after torchrun's own restarts, or the rendezvous
         failed; one line says which

Plain torchrun exits 1 with a traceback when it is sent SIGTERM, and 0 on every node whose
workers stopped cleanly, also when they stopped because another node was preempted. A
pod that exits 0 is done for good in an Indexed Job and makes a PyTorchJob with an elastic
policy "Succeeded", so the other pods could never resume. Here the workers of a node that
stopped because of another node's preemption ask this process (its pid and a folder are in
their environment) to end the pod with EXIT_PREEMPTED instead of restarting them: a
restart would wait in the rendezvous for a pod that the controller replaces only once this
one has ended too (see docs/checkpoints.md, "Preemption").

The c10d store lives in node 0's agent; torchrun guesses whether that is this node by
comparing the endpoint with the host's names, which misses the short DNS names pods
resolve each other by. Where the controller says which node this is
(``TORCHREC_CLOUD_NODE_RANK``, the Indexed Job's ``JOB_COMPLETION_INDEX``, Kubeflow
Trainer's ``PET_NODE_RANK``, Azure ML's and Vertex AI's ``NODE_RANK``, AWS Batch's
``AWS_BATCH_JOB_NODE_INDEX``), ``is_host`` is set from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 200

_WHY = {
    EXIT_PREEMPTED: "the run stopped for a preemption",
    EXIT_CONFIG: f"the workers stopped for good (their error is above); exit {EXIT_CONFIG}: a retry cannot help",
}
_PID_ENV = "TORCHREC_CLOUD_LAUNCHER_PID"
_DIR_ENV = "TORCHREC_CLOUD_LAUNCHER_DIR"
PEER_TIMEOUT_ENV = "TORCHREC_CLOUD_PEER_TIMEOUT_S"
_OUTCOME = "exit-code"  # the code a worker asked for, and why
_RUN = "run.json"  # written by the trainer when it starts: where its checkpoints go
_FINISHED = "finished"  # written by the trainer when the run finished
_HEARD = "peers-heard"  # written by the launcher: since when (time.monotonic()) every peer pod has beaten
LOST_PEER = "lost peer"  # how a pod ended for a lost peer starts its reason
# AWS Batch sets AWS_BATCH_JOB_NODE_INDEX on every node of a multi-node parallel job.
_NODE_RANK_ENVS = ("TORCHREC_CLOUD_NODE_RANK", "JOB_COMPLETION_INDEX", "PET_NODE_RANK", "NODE_RANK",
                   "AWS_BATCH_JOB_NODE_INDEX")
DEFAULT_PEER_TIMEOUT_S = 30.0
# The longest the agent (and a rank whose collective failed, preemption.wait_for_lost_peer)
# waits for the peer watch's verdict: only a hang of the watch itself (its verdict comes within
# about --peer_timeout_s) reaches it.
VERDICT_CAP_S = 300.0


# -- worker side ------------------------------------------------------------------------


def cpu_count() -> int:
    """The cores this process may run on (its affinity: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _folder() -> Optional[str]:
    return os.environ.get(_DIR_ENV) or None


def end_pod(code: int, reason: str = "") -> None:
    """Ask the launcher of this node (if any) to stop its workers and exit with ``code``
    instead of restarting them. Call it when the worker is about to exit with ``code``
    for a reason that a restart in place cannot fix. The first worker of a node to call it
    signals; later calls do nothing."""
    pid, folder = os.environ.get(_PID_ENV), _folder()
    if not pid or not folder or not _request(folder, code, reason):
        return
    # The launcher forwards SIGTERM to its workers while it stops them; this one has
    # finished its work and must get to its own exit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.kill(int(pid), signal.SIGTERM)
    except (ProcessLookupError, ValueError):
        pass


def report_run(checkpoint_path: Optional[str]) -> None:
    """The trainer started: the launcher reads where checkpoints go when it says which one
    the next start resumes from."""
    _write(_RUN, json.dumps({"checkpoint_path": checkpoint_path}))


def report_finished(step: int) -> None:
    """The run is finished: the only thing that lets the launcher exit 0."""
    _write(_FINISHED, json.dumps({"step": step}))


def pod_ending() -> Optional[tuple[int, str]]:
    """(code, reason) when this pod's launcher has decided to end the pod, else None."""
    folder = _folder()
    return _requested(folder) if folder else None


def peers_heard_since() -> Optional[float]:
    """Since when (``time.monotonic()``, one clock for every process of the host) this pod's
    launcher has heard a heartbeat from every peer pod; None when it has not (yet)."""
    folder = _folder()
    try:
        with open(os.path.join(folder, _HEARD)) as f:
            return float(f.read())
    except (TypeError, OSError, ValueError):
        return None


def _write(name: str, text: str, folder: Optional[str] = None) -> None:
    folder = folder or _folder()
    if not folder:
        return
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, name))
    except OSError:  # the launcher's folder is gone: it is exiting already
        pass


def _request(folder: str, code: int, reason: str) -> bool:
    """Record the pod's exit code once; False when one was recorded already."""
    try:
        fd = os.open(os.path.join(folder, _OUTCOME), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError:  # recorded already, or the launcher's folder is gone: it is exiting
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{code}\n{reason}")
    return True


def _requested(folder: str) -> Optional[tuple[int, str]]:
    try:
        with open(os.path.join(folder, _OUTCOME)) as f:
            code, _, reason = f.read().partition("\n")
        return int(code.strip()), reason.strip()
    except (OSError, ValueError):
        return None


# -- launcher side ----------------------------------------------------------------------


def _node_rank() -> Optional[str]:
    return next((os.environ[k].strip() for k in _NODE_RANK_ENVS if os.environ.get(k, "").strip()), None)


def _set_is_host(args: argparse.Namespace) -> None:
    if args.rdzv_backend != "c10d" or "is_host" in (args.rdzv_conf or ""):
        return
    rank = _node_rank()
    if rank is None:
        return
    conf = f"is_host={int(rank == '0')}"
    args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf


def _say(message: str) -> None:
    print(f"torchrec-cloud launch: {message}", file=sys.stderr, flush=True)


class _Pod:
    """What this launcher knows about its pod: the folder its workers report in, the
    heartbeats of its peers, and the one decision of its exit code."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.folder = tempfile.mkdtemp(prefix="torchrec-cloud-launch-")
        self.decided = threading.Lock()
        self.ending = threading.Event()  # the peer watch is ending the pod: the agent must not act
        self.watch = None
        nodes = _min_nodes(args.nnodes)
        if args.rdzv_backend == "c10d" and args.rdzv_endpoint and nodes > 1 and args.peer_timeout_s > 0:
            from torchrec_cloud.peerwatch import PeerWatch, describe_pod

            self.watch = PeerWatch(args.rdzv_endpoint, nodes, args.peer_timeout_s, describe_pod(_node_rank()),
                                   on_lost=self.end_for_lost_peer,
                                   on_heard=lambda since: _write(_HEARD, repr(since), self.folder))  # fmt: skip

    def finished(self) -> bool:
        return os.path.exists(os.path.join(self.folder, _FINISHED))

    def end_for_lost_peer(self, reason: str) -> None:
        """The peer watch's verdict (its thread): stop the workers and exit 200 now, whatever
        torchrun's agent is doing (it may be blocked on the lost store for many minutes)."""
        if not self.decided.acquire(blocking=False):
            return
        if self.finished():  # the run is over; the peer left with it
            self.decided.release()
            return
        # Set before the request the workers obey, so the agent, which sees them exit, has
        # stopped looking (hold_agent) by the time any does.
        self.ending.set()
        _request(self.folder, EXIT_PREEMPTED, f"{LOST_PEER}: {reason}")
        _say(f"{reason}: a peer pod is lost; stopping this pod's workers")
        _stop_children(grace_s=5.0)
        _say(f"exit {EXIT_PREEMPTED}: start the pod again; {self.resume_line()}")
        _remove(self.folder)
        os._exit(EXIT_PREEMPTED)

    def hold_agent(self) -> None:
        """Called by torchrun's agent before and after each look at its workers: once the peer
        watch is ending the pod, the agent waits here for the exit instead of seeing the
        workers it stops as failed, restarting them (a restart of --max_restarts spent) and
        rendezvousing with a pod that is gone."""
        while self.ending.is_set():
            time.sleep(3600)

    def verdict_before_restart(self, worker_group, result) -> None:
        """Called by torchrun's agent with the result of each look at its workers. When that
        result is one the agent restarts the workers for (a failed or unhealthy group, or a
        healthy one with a new pod waiting in the rendezvous), wait for the peer watch's
        verdict first: a lost peer ends this pod with 200 (``end_for_lost_peer``, from the
        watch's thread, while this one waits); every peer pod heard after the result (their
        pods are alive: the failure is this job's own, or the new pod is an addition) lets
        the agent go on as torchrun would. However a worker ended (a collective's exception,
        any exception, an abort from gloo's or NCCL's own threads, a signal), this is where
        the agent would count it: module ``peerwatch``'s docstring."""
        if self.watch is None or not self.watch.formed:
            return  # one pod, or a group the watch never saw form: no verdict can come
        from torch.distributed.elastic.agent.server.api import WorkerState

        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            what = f"the worker group {result.state.name}{_failure(result)}"
        elif result.state == WorkerState.HEALTHY and worker_group.spec.rdzv_handler.num_nodes_waiting() > 0:
            what = "a new pod waits in the rendezvous"
        else:
            return
        since = time.monotonic()
        _say(f"{what}: checking that every peer pod is alive before torchrun restarts the workers")
        deadline = since + max(VERDICT_CAP_S, 10 * self.watch.timeout_s)
        while time.monotonic() < deadline:
            self.hold_agent()
            heard = self.watch.heard_from_all()
            if heard is not None and heard > since:
                _say("every peer pod is alive: torchrun restarts the workers (--max_restarts)")
                return
            time.sleep(0.05)
        _say(f"no verdict on the peer pods in {deadline - since:g} s: torchrun restarts the workers")

    def resume_line(self) -> str:
        """Which checkpoint the next start of this job resumes from, read from the storage
        the workers reported (they have stopped: nothing is being committed by this pod)."""
        try:
            with open(os.path.join(self.folder, _RUN)) as f:
                root = json.load(f).get("checkpoint_path")
        except (OSError, ValueError):
            return "the workers did not start training: the next start resumes from the newest complete checkpoint, if any"
        if not root:
            return "no --checkpoint_path: the next start begins at step 0"
        found: list = []

        def look() -> None:
            from torchrec_cloud.checkpoint.store import newest_complete

            try:
                found.append(newest_complete(root, warn=False))
            except Exception as e:  # noqa: BLE001 - storage trouble: say so, do not hang the exit
                found.append(e)

        thread = threading.Thread(target=look, daemon=True)
        thread.start()
        thread.join(timeout=15)
        if not found or isinstance(found[0], Exception):
            why = f" ({found[0]})" if found else " (the storage did not answer in 15 s)"
            return f"the next start resumes from the newest complete checkpoint under {root}{why}"
        if found[0] is None:
            return f"no complete checkpoint under {root}: the next start begins at step 0"
        return f"the next start resumes from checkpoint step {found[0].step} ({found[0].path})"

    def decide(self, code: int, why: str) -> int:
        """The main thread's decision; waits for good when the peer watch has taken it."""
        self.decided.acquire()
        if self.watch is not None:
            self.watch.stop(finished=code == EXIT_OK)
        if code == EXIT_PREEMPTED:
            why = f"{why}; exit {EXIT_PREEMPTED}: start the pod again; {self.resume_line()}"
        _say(why)
        return code


def _agent_waits_for(pod: _Pod):
    """Have torchrun's agent (it runs in this process) call ``pod.hold_agent`` around each
    look at its workers (``_monitor_workers``, read in torch 2.13's
    distributed/elastic/agent/server/api.py ``_invoke_run``: a failed worker group is
    restarted, and ``will restart worker group`` logged, right after that look returns).
    Returns what puts the agent's own method back."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent.__dict__["_monitor_workers"]

    def monitor(agent, worker_group):
        pod.hold_agent()
        result = original(agent, worker_group)
        pod.verdict_before_restart(worker_group, result)
        pod.hold_agent()
        return result

    LocalElasticAgent._monitor_workers = monitor
    return lambda: setattr(LocalElasticAgent, "_monitor_workers", original)


def _failure(result) -> str:
    """``: local rank R exited with C`` for the first failure of a failed group's result."""
    failures = getattr(result, "failures", None) or {}
    if not failures:
        return ""
    rank, failure = min(failures.items())
    return f" (worker rank {rank}: exit code {failure.exitcode})"


def _min_nodes(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[0])
    except ValueError:
        return 1


def _stop_children(grace_s: float) -> None:
    """SIGTERM this process's children (the workers), then SIGKILL their process groups (a
    worker starts a session of its own) after ``grace_s`` or once they have exited."""
    children = _children(os.getpid())
    for pid in children:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(pid) for pid in children):
        time.sleep(0.05)
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            _signal(pid, signal.SIGKILL)


def _children(parent: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


_PEER_TIMEOUT_HELP = (f"seconds without a peer pod's heartbeat before this pod exits {EXIT_PREEMPTED} (0: do not "
                      f"watch; default: {DEFAULT_PEER_TIMEOUT_S:g})")


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own flags, and the one ``launch`` adds (``--peer_timeout_s``)."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # `--nnode=2` is refused, as every flag of ours
    parser.add_argument("--peer_timeout_s", "--peer-timeout-s", type=float, default=DEFAULT_PEER_TIMEOUT_S,
                        help=f"torchrec-cloud: {_PEER_TIMEOUT_HELP}")
    return parser


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv`` (its flags, then the command) in this process; returns the
    pod's exit code (module docstring)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError

    args = torchrun_parser().parse_args(argv)
    _set_is_host(args)

    def terminate(signum, frame):  # until torchrun's agent installs its own, which does the same
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    # A pod's first process ignores signals it has no handler for: without this, a SIGTERM
    # during the rendezvous would wait for the SIGKILL at the end of the grace period.
    signal.signal(signal.SIGTERM, terminate)
    pod = _Pod(args)
    os.environ[_PID_ENV] = str(os.getpid())
    os.environ[_DIR_ENV] = pod.folder
    os.environ[PEER_TIMEOUT_ENV] = str(args.peer_timeout_s)
    if pod.watch is not None:
        pod.watch.start()
    restore = _agent_waits_for(pod)
    try:
        try:
            torchrun.run(args)
        finally:
            restore()
            # The pod's outcome is decided: a SIGTERM now (the controller deleting the pod)
            # must not turn it into a death by signal.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if pod.finished():
            return pod.decide(EXIT_OK, "the workers finished the run; exit 0")
        return pod.decide(EXIT_FAILED, "the workers exited without finishing the run (none reported its end); "
                                       f"exit {EXIT_FAILED}")  # fmt: skip
    except SignalException as e:
        requested = _requested(pod.folder)
        if requested is not None:
            code, reason = requested
            return pod.decide(code, reason or _WHY.get(code, f"the workers stopped; exit {code}"))
        name = signal.Signals(e.sigval).name
        return pod.decide(EXIT_PREEMPTED, f"{name} received; the workers stopped")
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes <= {EXIT_CONFIG, EXIT_PREEMPTED}:
            code = EXIT_CONFIG if EXIT_CONFIG in codes else EXIT_PREEMPTED
            return pod.decide(code, _WHY[code])
        rank, failure = min(e.failures.items())
        return pod.decide(EXIT_FAILED, f"worker rank {rank} failed with exit code {failure.exitcode} after torchrun's "
                                       f"restarts (--max_restarts); its error is in the log above; exit {EXIT_FAILED}")  # fmt: skip
    except RendezvousClosedError:
        # Closed by a pod's agent that ended (after its restarts): this pod is not at fault.
        return pod.decide(EXIT_PREEMPTED, "the rendezvous was closed by a peer pod that ended")
    except RendezvousConnectionError as e:
        # The store answered before (the watch heard it, or this connection to it was open and
        # its host closed it): its host, pod 0, is gone. A pod started while the previous pod
        # 0 was still ending meets the second one before its watch has heard anything.
        if (pod.watch is not None and pod.watch.reached) or _closed_by_store_host(e):
            return pod.decide(EXIT_PREEMPTED, f"the rendezvous store (hosted by pod 0) is gone: {_one_line(e)}")
        return pod.decide(EXIT_FAILED, f"{type(e).__name__}: {_one_line(e)}; exit {EXIT_FAILED}")
    except Exception as e:  # noqa: BLE001 - the rendezvous and the agent: one line, not a traceback
        return pod.decide(EXIT_FAILED, f"{type(e).__name__}: {_one_line(e)}; exit {EXIT_FAILED}")
    finally:
        _remove(pod.folder)


# How a TCPStore client's open connection ends when the store's host goes: recvBytes and
# sendBytes raise these (torch 2.13 include/torch/csrc/distributed/c10d/Utils.hpp; a reset or
# a broken pipe as strerror's text through SYSCHECK). A store never reached says "timed out
# ... while trying to connect" instead: a wrong endpoint, which a restart cannot fix.
_CLOSED_BY_HOST = re.compile(r"Connection was likely closed|Connection reset by peer|Broken pipe")


def _closed_by_store_host(error: Optional[BaseException]) -> bool:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _CLOSED_BY_HOST.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def _remove(folder: str) -> None:
    for name in (_OUTCOME, _RUN, _FINISHED):
        try:
            os.remove(os.path.join(folder, name))
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="torchrun for Kubernetes pods: same flags, exit codes a controller can act on",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        prefix_chars="\0",  # every word goes to torchrun, --help included
    )
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=lambda ns: _help(parser) if ns.torchrun_args[:1] in (["-h"], ["--help"]) else
                        main(ns.torchrun_args))  # fmt: skip
    return parser


def _help(parser: argparse.ArgumentParser) -> int:
    """``launch --help``: what it adds to torchrun (the exit codes), and where torchrun's own
    flags are listed; every one of them is taken here as torchrun takes it."""
    print(f"usage: {parser.prog} [TORCHRUN FLAGS] (-m MODULE | SCRIPT) [ARGS ...]\n")
    print(parser.description)
    print("Flags: every flag of torchrun, as torchrun takes it (`torchrun --help` lists them), and one\n"
          f"of its own:\n\n  --peer_timeout_s S   {_PEER_TIMEOUT_HELP}\n\n"
          "The rendered pods set --nnodes, --nproc_per_node, --rdzv_backend, --rdzv_endpoint, --rdzv_id,\n"
          "--max_restarts, --shutdown_timeout and --peer_timeout_s.")
    return EXIT_OK
