"""``torchrec-cloud launch``: torchrun for pods, with exit codes a controller can act on.

    torchrec-cloud launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 --rdzv_id=myjob -m torchrec_cloud train --preset criteo-1tb

It takes torchrun's flags, and the ``PET_*`` variables the Kubeflow operators set, unchanged,
and runs torchrun's elastic agent in this process. What it adds is the pod's exit code,
which is what Kubernetes acts on (a Job's podFailurePolicy, PyTorchJob's ExitCode restart
policy, a JobSet's failure policy)::

    0    every worker finished the run: the only way a pod of this job exits 0
    2    the workers refused their flags or configuration: a retry cannot help
    200  EXIT_PREEMPTED: the run stopped for a preemption (this pod's SIGTERM, or a peer
         pod's: every rank finished its step and the checkpoint is saved); start the pod
         again and it resumes. The workers exit with it too.
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
import os
import signal
import sys
import tempfile
from typing import Optional

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 200

_WHY = {
    EXIT_PREEMPTED: f"the run stopped for a preemption (checkpoint saved where one is configured); exit "
    f"{EXIT_PREEMPTED}: started again, the pod resumes",
    EXIT_CONFIG: f"the workers refused their flags or configuration (the error is above); exit {EXIT_CONFIG}: "
    "a retry cannot help",
}
_PID_ENV = "TORCHREC_CLOUD_LAUNCHER_PID"
_DIR_ENV = "TORCHREC_CLOUD_LAUNCHER_DIR"
_OUTCOME = "exit-code"
# AWS Batch sets AWS_BATCH_JOB_NODE_INDEX on every node of a multi-node parallel job.
_NODE_RANK_ENVS = ("TORCHREC_CLOUD_NODE_RANK", "JOB_COMPLETION_INDEX", "PET_NODE_RANK", "NODE_RANK",
                   "AWS_BATCH_JOB_NODE_INDEX")


# -- worker side ------------------------------------------------------------------------


def end_pod(code: int) -> None:
    """Ask the launcher of this node (if any) to stop its workers and exit with ``code``
    instead of restarting them. Call it when the worker is about to exit with ``code``
    for a reason that a restart in place cannot fix. The first worker of a node to call it
    signals; later calls do nothing."""
    pid, folder = os.environ.get(_PID_ENV), os.environ.get(_DIR_ENV)
    if not pid or not folder:
        return
    try:
        fd = os.open(os.path.join(folder, _OUTCOME), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    except OSError:  # the launcher's folder is gone: it is exiting already
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(code))
    # The launcher forwards SIGTERM to its workers while it stops them; this one has
    # finished its work and must get to its own exit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.kill(int(pid), signal.SIGTERM)
    except (ProcessLookupError, ValueError):
        pass


def _requested(folder: str) -> Optional[int]:
    try:
        with open(os.path.join(folder, _OUTCOME)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# -- launcher side ----------------------------------------------------------------------


def _set_is_host(args: argparse.Namespace) -> None:
    if args.rdzv_backend != "c10d" or "is_host" in (args.rdzv_conf or ""):
        return
    rank = next((os.environ[k] for k in _NODE_RANK_ENVS if os.environ.get(k, "").strip()), None)
    if rank is None:
        return
    conf = f"is_host={int(rank.strip() == '0')}"
    args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf


def _say(message: str) -> None:
    print(f"torchrec-cloud launch: {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv`` (its flags, then the command) in this process; returns the
    pod's exit code (module docstring)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # `--nnode=2` is refused, as every flag of ours
    args = parser.parse_args(argv)
    _set_is_host(args)

    def terminate(signum, frame):  # until torchrun's agent installs its own, which does the same
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    # A pod's first process ignores signals it has no handler for: without this, a SIGTERM
    # during the rendezvous would wait for the SIGKILL at the end of the grace period.
    signal.signal(signal.SIGTERM, terminate)
    folder = tempfile.mkdtemp(prefix="torchrec-cloud-launch-")
    os.environ[_PID_ENV] = str(os.getpid())
    os.environ[_DIR_ENV] = folder
    try:
        try:
            torchrun.run(args)
        finally:
            # The pod's outcome is decided: a SIGTERM now (the controller deleting the pod)
            # must not turn it into a death by signal.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return EXIT_OK
    except SignalException as e:
        requested = _requested(folder)
        if requested is not None:
            _say(_WHY.get(requested, f"the workers stopped; exit {requested}"))
            return requested
        name = signal.Signals(e.sigval).name
        _say(f"{name} received; the workers finished their step and saved a checkpoint where one is "
             f"configured; exit {EXIT_PREEMPTED} (start the pod again to resume)")  # fmt: skip
        return EXIT_PREEMPTED
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes <= {EXIT_CONFIG, EXIT_PREEMPTED}:
            code = EXIT_CONFIG if EXIT_CONFIG in codes else EXIT_PREEMPTED
            _say(_WHY[code])
            return code
        rank, failure = min(e.failures.items())
        _say(
            f"worker rank {rank} failed with exit code {failure.exitcode} after torchrun's restarts "
            f"(--max_restarts); its error is in the log above; exit {EXIT_FAILED}"
        )
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - the rendezvous and the agent: one line, not a traceback
        _say(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}; exit {EXIT_FAILED}")
        return EXIT_FAILED
    finally:
        _remove(folder)


def _remove(folder: str) -> None:
    try:
        os.remove(os.path.join(folder, _OUTCOME))
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
    print("Flags: every flag of torchrun, as torchrun takes it (`torchrun --help` lists them); the\n"
          "rendered pods set --nnodes, --nproc_per_node, --rdzv_backend, --rdzv_endpoint, --rdzv_id,\n"
          "--max_restarts and --shutdown_timeout.")
    return EXIT_OK
