"""Preemption as Kubernetes runs it: each launcher's rendered pods rehearsed as processes
under its controller's rules (``torchrec-cloud rehearse``), with a pod preempted (SIGTERM,
DisruptionTarget) or killed (SIGKILL of all its processes) mid-run.

Whatever pod is lost, the job must complete with the final metrics of an uninterrupted
run, bit for bit (the run resumes from the SIGTERM checkpoint, or from the last periodic
one after a kill), and no pod may exit 0 before its last attempt: a pod that exits 0 is
never started again (Indexed Job) or ends the whole job (an elastic PyTorchJob).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import env_for_subprocess
from torchrec_cloud.launch import EXIT_PREEMPTED

TINY = [
    "--num_embeddings", "1000", "--embedding_dim", "16", "--dense_arch_layer_sizes", "32,16",
    "--over_arch_layer_sizes", "32,1", "--batch_size", "64", "--num_batches_per_epoch", "20",
    "--num_epochs", "3", "--num_eval_batches", "2", "--log_every", "1", "--checkpoint_interval", "10",
    "--no-progress", "--no-tensorboard",
]  # fmt: skip
STEP = 25  # of 60: after the checkpoint of step 20, well before the end
LAUNCHERS = ["job", "pytorchjob", "trainjob"]


def rehearse(tmp_path, launcher: str, nodes: int = 2, *faults: str, train: tuple[str, ...] = ()) -> dict:
    out = tmp_path / f"{launcher}-{nodes}-{'-'.join(f.replace('@', 'at') for f in faults) or 'clean'}"
    cmd = [sys.executable, "-m", "torchrec_cloud", "rehearse", "--cloud", "generic", "--launcher", launcher,
           "--nodes", str(nodes), "--output", str(out), "--json", "--timeout", "400",
           # The Job controller's retry delay (10 s, doubling) a tenth as long: the same rules.
           "--delay_scale", "0.1", *faults, "--", *TINY, *train]  # fmt: skip
    proc = subprocess.run(cmd, env=env_for_subprocess(), capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(lines[-1])
    report["log"] = proc.stdout
    assert proc.returncode == (0 if report["completed"] else 1)
    return report


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The run without faults, per launcher (and the 3-pod Indexed Job)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {(launcher, nodes): rehearse(tmp, launcher, nodes) for launcher, nodes in
            [*((launcher, 2) for launcher in LAUNCHERS), ("job", 3)]}  # fmt: skip


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


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_uninterrupted_job_completes_and_every_pod_serves_metrics(uninterrupted, launcher):
    report = uninterrupted[(launcher, 2)]
    assert report["completed"] and report["restarts"] == 0, report["log"][-3000:]
    assert [p["exit_codes"] for p in report["pods"]] == [[0], [0]]
    assert all(p["metrics_served"] for p in report["pods"]), report["pods"]
    assert report["final"]["step"] == 60 and 0.5 < report["final"]["val_auc"] < 1


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("pod", [1, 0])
def test_a_preempted_pod_resumes_the_job_to_the_same_result(uninterrupted, tmp_path, launcher, pod):
    report = rehearse(tmp_path, launcher, 2, "--preempt", f"{pod}@{STEP}")
    assert report["faults"][0]["fired"]
    assert_same_job(report, uninterrupted[(launcher, 2)])
    # Every pod stopped for the preemption with the launcher's own code, then resumed.
    assert [p["exit_codes"] for p in report["pods"]] == [[EXIT_PREEMPTED, 0], [EXIT_PREEMPTED, 0]]
    assert len(report["resumes"]) == 1 and STEP <= report["resumes"][0] < 60
    if launcher == "trainjob":
        assert "rule 'preempted': RestartJobSetAndIgnoreMaxRestarts" in report["log"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_killed_pod_resumes_the_job_from_the_last_checkpoint(uninterrupted, tmp_path, launcher):
    report = rehearse(tmp_path, launcher, 2, "--kill", f"1@{STEP}")
    assert report["faults"][0]["fired"]
    assert_same_job(report, uninterrupted[(launcher, 2)])
    assert report["pods"][1]["exit_codes"][0] == 137  # SIGKILL, counted as a failure
    assert report["resumes"] and report["resumes"][0] in (20, 30), report["resumes"]


def test_three_pod_indexed_job_with_its_last_pod_preempted(uninterrupted, tmp_path):
    """Three ranks add each gradient element in an order set by DDP's bucket layout, which
    DDP rebuilds after the first step of every start; the first step after the resume
    may round one addition differently (2 ranks: a + b == b + a, hence bitwise above)."""
    report = rehearse(tmp_path, "job", 3, "--preempt", f"2@{STEP}")
    assert_same_job(report, uninterrupted[("job", 3)], bitwise=False)
    assert [p["exit_codes"] for p in report["pods"]] == [[EXIT_PREEMPTED, 0]] * 3


def test_a_refused_flag_fails_the_job_at_once_without_retries(tmp_path):
    """Exit code 2 (a flag the trainer refuses at start-up) is FailJob, not a retry loop."""
    report = rehearse(tmp_path, "job", 2, train=("--checkpoint_path", "/proc/no-such/place"))
    assert not report["completed"] and "PodFailurePolicy" in report["outcome"], report["log"][-3000:]
    assert "failed with exit code 2 matching FailJob rule" in report["outcome"]
    assert all(len(p["exit_codes"]) == 1 for p in report["pods"]), report["pods"]
