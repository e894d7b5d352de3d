"""Spot reclaims, lost nodes and evictions as Kubernetes runs them: each launcher's rendered
pods rehearsed as processes under its controller's rules (``torchrec-cloud rehearse``).

Whatever pod is reclaimed (15 s of grace and a save that cannot fit them) or lost (frozen:
no TCP reset reaches its peers; replaced only after the unreachable toleration and PodGC),
pod 0 and its rendezvous store included, the job must complete with the final metrics of an
uninterrupted run, bit for bit, every restart resuming from the last checkpoint committed
before it; no pod may exit 0 before its last attempt (a pod that exits 0 is never started
again by an Indexed Job, and ends an elastic PyTorchJob) nor 1 in any attempt (a counted
failure: a PyTorchJob fails at once). An eviction loop ends, permanently, after
``--no_progress_restarts`` starts that resumed from the same checkpoint.

The assertions hold whatever the machine's speed: a slow pod that its peers take for lost
costs one more restart, which they allow. Every launcher runs the same 2 ranks on the same
data, so one uninterrupted run (an Indexed Job's) is the reference for all of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env_for_subprocess
from torchrec_cloud.checkpoint.checkpointer import TEST_SAVE_DELAY_ENV
from torchrec_cloud.launch import EXIT_CONFIG, EXIT_PREEMPTED

TINY = [
    "--num_embeddings", "1000", "--embedding_dim", "16", "--dense_arch_layer_sizes", "32,16",
    "--over_arch_layer_sizes", "32,1", "--batch_size", "64", "--num_batches_per_epoch", "20",
    "--num_epochs", "3", "--num_eval_batches", "2", "--log_every", "1", "--checkpoint_interval", "10",
    "--no-progress", "--no-tensorboard",
]  # fmt: skip
STEP = 25  # of 60: after the checkpoint of step 20, well before the end
LATER = 45  # a second fault, in the attempt after the first
LAUNCHERS = ["job", "pytorchjob", "trainjob"]
# Far more than 15 s: a save on SIGTERM does not fit a GKE reclaim's grace.
SLOW_SAVE = {TEST_SAVE_DELAY_ENV: "30"}


def rehearse(tmp_path, launcher: str, nodes: int = 2, *faults: str, train: tuple[str, ...] = (),
             env: dict[str, str] | None = None) -> dict:  # fmt: skip
    out = tmp_path / f"{launcher}-{nodes}-{'-'.join(f.replace('@', 'at') for f in faults) or 'clean'}"
    cmd = [sys.executable, "-m", "torchrec_cloud", "rehearse", "--cloud", "generic", "--launcher", launcher,
           "--nodes", str(nodes), "--output", str(out), "--json", "--timeout", "500",
           # The controllers' delays and a lost node's 410 s 1/200 as long: the same rules.
           "--delay_scale", "0.005", "--peer_timeout_s", "6", *faults, "--", *TINY, *train]  # fmt: skip
    proc = subprocess.run(cmd, env={**env_for_subprocess(), **(env or {})}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(lines[-1])
    report["log"] = proc.stdout
    metrics = out / "run" / "metrics.jsonl"
    report["records"] = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert proc.returncode == (0 if report["completed"] else 1)
    # The pod a fault is set for waits at its step: the fault lands there on any machine.
    assert all(f["fired_step"] == f["step"] for f in report["faults"] if f["fired"]), report["faults"]
    return report


def pod_logs(report: dict) -> str:
    return "\n".join(Path(log).read_text() for pod in report["pods"] for log in pod["logs"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The run without faults on 2 pods (and on 3), an Indexed Job's."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {nodes: rehearse(tmp, "job", nodes) for nodes in (2, 3)}


def assert_same_job(report: dict, reference: dict, bitwise: bool = True) -> None:
    assert report["completed"], report["log"][-3000:]
    assert report["final"]["step"] == reference["final"]["step"] == 60
    if bitwise:  # the same batches after the resume, from exactly the saved state
        assert report["final"]["val_logloss"] == reference["final"]["val_logloss"], (report["final"], reference["final"])
        assert report["final"]["val_auc"] == reference["final"]["val_auc"]
    else:
        assert report["final"]["val_logloss"] == pytest.approx(reference["final"]["val_logloss"], rel=1e-6, abs=0)
        assert report["final"]["val_auc"] == pytest.approx(reference["final"]["val_auc"], abs=1e-6)
    for pod in report["pods"]:
        assert 0 not in pod["exit_codes"][:-1], f"pod {pod['index']} exited 0 before its last attempt: {pod}"
        assert pod["exit_codes"][-1] == 0, pod


def last_checkpoints_before_restarts(records: list[dict]) -> list[int]:
    """For every start after the first, the step of the last checkpoint committed before it."""
    out, last, starts = [], 0, 0
    for r in records:
        if r.get("event") == "checkpoint":
            last = r["step"]
        elif r.get("event") == "start":
            starts += 1
            if starts > 1:
                out.append(last)
    return out


def test_uninterrupted_job_completes_and_every_pod_serves_metrics(uninterrupted):
    report = uninterrupted[2]
    assert report["completed"] and report["restarts"] == 0, report["log"][-3000:]
    assert [p["exit_codes"] for p in report["pods"]] == [[0], [0]]
    assert all(p["metrics_served"] for p in report["pods"]), report["pods"]
    assert report["final"]["step"] == 60 and 0.5 < report["final"]["val_auc"] < 1
    assert report["resumed_from"] == []


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("reclaimed, lost", [(0, 1), (1, 0)])
def test_a_reclaim_and_a_lost_node_resume_from_the_last_checkpoint(uninterrupted, tmp_path, launcher, reclaimed, lost):
    """A reclaim with a 15 s grace (the generic profile's, GKE's) and a save that needs 30:
    no save on SIGTERM, every pod stops at once; then, in the next attempt, a node that
    vanishes. Pod 0 hosts the rendezvous store in either case."""
    report = rehearse(tmp_path, launcher, 2, "--reclaim", f"{reclaimed}@{STEP}", "--lose", f"{lost}@{LATER}",
                      env=SLOW_SAVE)  # fmt: skip
    assert all(f["fired"] for f in report["faults"]), report["faults"]
    assert_same_job(report, uninterrupted[2])
    assert all(p["metrics_served"] for p in report["pods"]), report["pods"]
    for pod in report["pods"]:
        assert 1 not in pod["exit_codes"], f"pod {pod['index']} exited 1 (a counted crash): {pod}"
    # The reclaimed pod stopped by itself within the grace, without trying a save it had
    # no time for: the run resumed from the last periodic checkpoint.
    assert report["pods"][reclaimed]["exit_codes"][0] == EXIT_PREEMPTED, report["pods"]
    assert not [r for r in report["records"] if r.get("event") == "checkpoint" and r["reason"] == "preempted"]
    assert len(report["resumed_from"]) >= 2 and report["resumed_from"][0] == 20, report["resumed_from"]
    assert report["resumed_from"] == last_checkpoints_before_restarts(report["records"])
    logs = pod_logs(report)
    assert "not saving (a save took" in logs and "a peer pod is lost" in logs
    assert f"exit {EXIT_PREEMPTED}: start the pod again; the next start resumes from checkpoint step 20" in logs
    if launcher == "trainjob":
        assert "rule 'preempted': RestartJobSetAndIgnoreMaxRestarts" in report["log"]


def test_a_drained_pod_saves_on_sigterm_and_the_job_resumes_from_it(uninterrupted, tmp_path):
    """A drain leaves the pod its whole terminationGracePeriodSeconds: the save fits."""
    report = rehearse(tmp_path, "job", 2, "--preempt", f"0@{STEP}")
    assert_same_job(report, uninterrupted[2])
    assert [p["exit_codes"] for p in report["pods"]] == [[EXIT_PREEMPTED, 0], [EXIT_PREEMPTED, 0]]
    # The run resumed from the step where every rank stopped: nothing was lost.
    (resumed,) = report["resumed_from"]
    assert STEP <= resumed < 60
    assert f"stopping at step {resumed} on every rank for a preemption (SIGTERM); saving checkpoint step {resumed}" \
        in pod_logs(report)


def test_a_killed_pod_is_a_counted_crash_of_that_pod_only(uninterrupted, tmp_path):
    """kill -9 of pod 1, then of pod 0 with the rendezvous store (OOM kills): each killed pod
    fails (137, counted per index); the other's collectives break at once, and it exits 200
    once its launcher hears the peer's heartbeats stop (or loses the store), rather than
    restart its workers in place (spending --max_restarts) or exit 1."""
    # LOGLEVEL=INFO: torchrun's agent says when it restarts its workers in place.
    report = rehearse(tmp_path, "job", 2, "--kill", f"1@{STEP}", "--kill", f"0@{LATER}", env={"LOGLEVEL": "INFO"})
    assert all(f["fired"] for f in report["faults"]), report["faults"]
    assert_same_job(report, uninterrupted[2])
    assert report["pods"][1]["exit_codes"][0] == 137 and report["pods"][0]["exit_codes"][0] == EXIT_PREEMPTED
    assert 137 in report["pods"][0]["exit_codes"][1:], report["pods"]
    for pod in report["pods"]:
        assert 1 not in pod["exit_codes"], report["pods"]
    assert "will restart worker group" not in pod_logs(report)  # no --max_restarts spent on a peer's loss
    assert report["resumed_from"] == last_checkpoints_before_restarts(report["records"])
    assert "failure 1 counted" in report["log"]


def test_three_pod_indexed_job_with_its_last_pod_preempted(uninterrupted, tmp_path):
    """Three ranks add each gradient element in an order set by DDP's bucket layout, which
    DDP rebuilds after the first step of every start; the first step after the resume
    may round one addition differently (2 ranks: a + b == b + a, hence bitwise above)."""
    report = rehearse(tmp_path, "job", 3, "--preempt", f"2@{STEP}")
    assert_same_job(report, uninterrupted[3], bitwise=False)
    assert [p["exit_codes"] for p in report["pods"]] == [[EXIT_PREEMPTED, 0]] * 3


def test_an_eviction_loop_ends_after_the_no_progress_budget(tmp_path):
    """A pod evicted for node memory pressure early in every attempt (a leak, with no memory
    limit to make it an OOM kill), before the first checkpoint (step 30): every start begins
    at step 0 again, and the third (the first start and one restart began there too) gives
    up for good (exit 2, FailJob) instead of looping uncounted."""
    evictions = [arg for _ in range(3) for arg in ("--evict", "1@5")]
    report = rehearse(tmp_path, "job", 2, *evictions, train=("--checkpoint_interval", "30", "--no_progress_restarts", "2"),
                      env=SLOW_SAVE)  # fmt: skip
    assert not report["completed"], report["log"][-3000:]
    assert "PodFailurePolicy" in report["outcome"] and f"exit code {EXIT_CONFIG} matching FailJob" in report["outcome"]
    assert report["resumed_from"] == [0], report["resumed_from"]
    assert "no progress since step 0 in 2 restarts: " in pod_logs(report)
    for pod in report["pods"]:
        assert 0 not in pod["exit_codes"] and 1 not in pod["exit_codes"], report["pods"]


def test_a_refused_flag_fails_the_job_at_once_without_retries(tmp_path):
    """Exit code 2 (a flag the trainer refuses at start-up) is FailJob, not a retry loop."""
    report = rehearse(tmp_path, "job", 2, train=("--checkpoint_path", "/proc/no-such/place"))
    assert not report["completed"] and "PodFailurePolicy" in report["outcome"], report["log"][-3000:]
    assert "failed with exit code 2 matching FailJob rule" in report["outcome"]
    assert all(len(p["exit_codes"]) == 1 for p in report["pods"]), report["pods"]


def test_pytorchjob_backoff_limit_as_training_operator_v1_9_applies_it():
    """Under restartPolicy ExitCode a backoffLimit of 1 or more never fails the job (a
    crash loop of OOM kills, 137, is recreated forever), and 0 fails it at the first
    preemption: why the bundle sets none and the trainer counts progress instead."""
    from torchrec_cloud.deploy.manifests import load_documents, render_bundle
    from torchrec_cloud.deploy.spec import DeploySpec
    from torchrec_cloud.rehearse.controllers import PyTorchJob
    from torchrec_cloud.rehearse.pods import Attempt

    (doc,) = [d for d in load_documents(render_bundle(DeploySpec(launcher="pytorchjob", nodes=2, gpus_per_node=0)))
              if d["kind"] == "PyTorchJob"]  # fmt: skip
    for limit, code, failed_after in ((3, 137, None), (0, EXIT_PREEMPTED, 1)):
        doc["spec"]["runPolicy"]["backoffLimit"] = limit
        job = PyTorchJob(doc, pods=None, say=lambda line: None, delay_scale=1.0)
        try:
            for n in range(1, 11):
                job.on_exit(Attempt(1, n, None, 0.0, Path("log"), None, b"", exit_code=code))
                if job.outcome is not None:
                    break
        finally:
            job.close()
        assert (n if job.outcome else None) == failed_after, (limit, job.outcome)
        assert (job.outcome or "").startswith("failed (BackoffLimitExceeded") == (failed_after is not None)


def test_a_trainjob_pod_of_the_previous_run_ending_after_a_restart_is_no_failure_of_the_new_one():
    """Both pods of a TrainJob end together (a reclaimed pod and its peer, exit 200): the
    JobSet restarts once. The second pod's end, seen after the restart, belongs to a Job of
    the previous run, which JobSet only deletes (getChildJobs): no second restart."""
    from torchrec_cloud.deploy.manifests import load_documents, render_bundle
    from torchrec_cloud.deploy.spec import DeploySpec
    from torchrec_cloud.rehearse.controllers import JobSet
    from torchrec_cloud.rehearse.pods import Attempt

    class NoPods:  # both pods have ended: none is live, none needs terminating
        live: list = []

    bundle = render_bundle(DeploySpec(launcher="trainjob", nodes=2, gpus_per_node=0))
    docs = {d["kind"]: d for d in load_documents(bundle)}
    job = JobSet(docs["TrainJob"], docs["TrainingRuntime"], pods=NoPods(), say=lambda line: None, delay_scale=1.0)
    try:
        # Pod 1 reclaimed (DisruptionTarget), pod 0 stopped with it: both exit 200.
        ended = [Attempt(i, 1, None, 0.0, Path("log"), None, b"", disrupted=i == 1, exit_code=EXIT_PREEMPTED)
                 for i in (0, 1)]  # fmt: skip
        for index, attempt in enumerate(ended):
            job.attempts[index].append(attempt)
        for attempt in ended:  # reaped in one tick, in this order
            job.on_exit(attempt)
    finally:
        job.close()
    assert (job.outcome, job.restarts, sorted(job.pending)) == (None, 1, [0, 1])
