"""``torchrec-cloud rehearse``: a rendered job's pods run on this machine, as its controller
would run them, with the faults a cluster brings. Rehearse here before paying for GPUs::

    torchrec-cloud rehearse --launcher job --nodes 2 --preempt 1@20 -- --num_epochs 2
    torchrec-cloud rehearse --cloud gcp --launcher trainjob --nodes 2 --reclaim 0@15 --lose 1@40 --json
    torchrec-cloud rehearse --launcher pytorchjob --nodes 2 --evict 1@25 --evict 1@25 --evict 1@25
    torchrec-cloud rehearse --job preprocess --nodes 2 --kill 1@1 -- --schema schema.yaml \\
        --input events/ --output shards/

The bundle is the one ``render`` writes for the same flags (it passes the same admission
checks), with this machine's folders as the run's output and checkpoint destination
(``--output``). Each pod's container command runs as a process group of its own with the
pod's environment (``pods.py``), under its launcher's controller: Kubernetes' Job
controller (``job``), Kubeflow Training Operator v1.9 (``pytorchjob``), Kubeflow Trainer
v2.3 with JobSet v0.12 (``trainjob``); each rule names its source in ``controllers.py``.

Faults (``faults.py``), each firing once its pod's attempt has seen the run log step STEP,
where that pod's trainer waits for it (``--job preprocess``: once the pod's share has
committed STEP shards, one of them in this attempt), each repeatable:

  --preempt POD@STEP  a drain: DisruptionTarget, SIGTERM, SIGKILL after the pod's grace
  --reclaim POD@STEP  a spot reclaim: DisruptionTarget, SIGTERM, SIGKILL after the cloud's
                      reclaim grace (the profile's: GKE 15 s, Azure 30 s, AWS 120 s;
                      --grace_s); no signal to other pods; renders the job with --spot
  --evict POD@STEP    a node-pressure eviction: DisruptionTarget, SIGTERM, SIGKILL after 2 s
  --kill POD@STEP     an OOM kill: SIGKILL to every process of the pod (exit 137, counted)
  --lose POD@STEP     the node vanishes: the pod's processes freeze (no TCP reset reaches
                      a peer); the controller replaces it only after the unreachable
                      toleration and PodGC (the profile's lost_node times, x --delay_scale)

Exit code 0 when the job completes as its controller would see it; ``--json`` ends with one
JSON object (``completed``, ``outcome``, ``pods``, ``restarts``, ``faults``, ``final``,
``resumes``, ``resumed_from``: the checkpoint step each restart resumed from). A
preprocessing job (``--job preprocess``, its ``data preprocess`` flags after ``--``) writes
the dataset where its ``--output`` says; it completes once its manifest is there (``final``:
its ``rows`` and ``shards``).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from torchrec_cloud.deploy.spec import add_spec_flags

    parser = subparsers.add_parser(
        "rehearse",
        help="run a rendered job's pods on this machine under its controller's rules, with faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc_per_node", type=int, default=1, help="trainer processes per pod (default: 1)")
    faults = {
        "preempt": "drain pod POD (DisruptionTarget, SIGTERM, SIGKILL after its grace)",
        "reclaim": "reclaim pod POD's spot node (SIGTERM, SIGKILL after the cloud's reclaim grace)",
        "evict": "evict pod POD for node memory pressure (SIGTERM, SIGKILL after 2 s)",
        "kill": "SIGKILL every process of pod POD",
        "lose": "lose pod POD's node (its processes freeze; replaced after the toleration and PodGC)",
    }
    for kind, what in faults.items():
        parser.add_argument(f"--{kind}", action="append", default=[], metavar="POD@STEP",
                            help=f"{what} once step STEP is logged; repeatable")  # fmt: skip
    parser.add_argument("--grace_s", type=float, default=None,
                        help="seconds a --reclaim leaves the pod (default: the profile's spot.reclaim_grace_s)")
    parser.add_argument("--output", metavar="DIR",
                        help="an empty or new folder for the run, its checkpoints, the pods' logs "
                             "(default: runs/rehearse/NAME-TIME)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600, help="give up after this many seconds (default: 3600)")
    parser.add_argument("--delay_scale", type=float, default=1.0,
                        help="multiply the controllers' retry delays and a lost node's timeouts "
                             "(default: 1, as a cluster)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="end with one JSON object of what happened")
    add_spec_flags(parser, exclude=("gpus_per_node", "procs_per_node", "instance_type", "reclaim_grace_s"))
    parser.set_defaults(func=_run)
    return parser


def _run(ns: argparse.Namespace) -> int:
    from torchrec_cloud.rehearse.rehearsal import run

    return run(ns)
