"""The controllers' rules, replayed from the rendered objects: one class per launcher, each
rule with the source file and version it was read from (docs/deploy.md, "Preemption, as
each controller runs it").

* ``job``: :class:`IndexedJob`, Kubernetes' Job controller (kubernetes v1.33,
  ``pkg/controller/job``): :class:`JobRules`.
* ``pytorchjob``: :class:`PyTorchJob`, Kubeflow Training Operator v1.9.0
  (``pkg/controller.v1/common/pod.go`` and ``job.go``, ``pkg/core/job.go``,
  ``pkg/controller.v1/pytorch/pytorchjob_controller.go``).
* ``trainjob``: :class:`JobSet`, the JobSet that Kubeflow Trainer v2.3.0 makes from the
  TrainingRuntime, run by JobSet v0.12.0 (``pkg/controllers/failure_policy.go``,
  ``jobset_controller.go``), its one Job by the Job controller.

Where a rule depends on timing, the worst real case is modelled: a replacement waits the
longest delay the source allows, a restart waits for every old pod to be gone.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Optional

from torchrec_cloud.ports import free_port
from torchrec_cloud.rehearse.pods import Attempt, PodTemplate, PodZeroAddress, Pods


class Controller:
    """What the launcher's controller does with its pods; subclasses fill in the rules."""

    endpoint: Optional[str] = None  # pod 0's address as the pods' command names it

    def __init__(self, pods: Pods, template: PodTemplate, nodes: int, say: Callable[[str], None],
                 delay_scale: float) -> None:  # fmt: skip
        self.pods = pods
        self.template = template
        self.nodes = nodes
        self.say = say
        self.delay_scale = delay_scale
        self.address = PodZeroAddress()
        self.attempts: dict[int, list[Attempt]] = {i: [] for i in range(nodes)}
        self.current: dict[int, Optional[Attempt]] = {i: None for i in range(nodes)}
        self.pending: dict[int, float] = {i: 0.0 for i in range(nodes)}  # index -> start not before
        self.outcome: Optional[str] = None  # "complete" or the failure's reason
        self.restarts = 0
        self.on_start: Callable[[Attempt], None] = lambda attempt: None
        self._delete_at: Optional[tuple[float, str]] = None

    def pod_env(self, index: int, rendezvous: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
        """(the pod's labels and annotations, the variables its operator sets)."""
        raise NotImplementedError

    def on_exit(self, attempt: Attempt) -> None:
        raise NotImplementedError

    # shared mechanics
    @property
    def finished(self) -> bool:
        return self.outcome is not None and not self.pods.live

    def tick(self) -> None:
        now = time.monotonic()
        if self._delete_at is not None and now >= self._delete_at[0]:
            self.terminate_active(self._delete_at[1])
            self._delete_at = None
        for index, not_before in list(self.pending.items()):
            if now >= not_before and self.outcome is None:
                del self.pending[index]
                # Pod 0 listens on an address of its own (its IP); the others reach it by name.
                port = free_port() if index == 0 else None
                rendezvous = f"127.0.0.1:{port}" if port else self.address.endpoint
                metadata, extra = self.pod_env(index, rendezvous)
                attempt = self.pods.start(index, self.template, metadata, extra, self.endpoint, rendezvous)
                self.on_start(attempt)
                self.attempts[index].append(attempt)
                self.current[index] = attempt
                if port:
                    self.address.point_to(port)
        for attempt in self.pods.reap():
            self.current[attempt.index] = None
            if attempt.index == 0:
                self.address.point_to(None)
            self.say(f"{attempt.name}: exited {attempt.exit_code}" + (" (its node was lost)" if attempt.lost else ""))
            self.on_exit(attempt)

    def replace(self, index: int, delay_s: float = 0.0, why: str = "") -> None:
        delay_s *= self.delay_scale
        self.pending[index] = time.monotonic() + delay_s
        self.say(f"pod {index}: {why}; replaced" + (f" in {delay_s:.1f} s" if delay_s else ""))

    def terminate_active(self, why: str) -> None:
        for attempt in list(self.pods.live):
            self.pods.terminate(attempt, self.template.grace_s, why)
        self.pending.clear()

    def finish(self, outcome: str, delete_why: str, after_s: float = 0.0) -> None:
        """The job's end; the pods still running are deleted (after ``after_s``: the
        controller's next reconcile)."""
        if self.outcome is None:
            self.outcome = outcome
            self.say(f"job: {outcome}")
            self.pending.clear()
            self._delete_at = (time.monotonic() + after_s, delete_why)

    def close(self) -> None:
        self.address.close()


# -- Kubernetes' Job controller ----------------------------------------------------------


def _matches_exit_codes(rule: dict[str, Any], container: str, a: Attempt) -> bool:
    """pod_failure_policy.go, getMatchingContainerFromList: only a terminated container with a
    non-zero exit code matches; a pod whose node is lost has no terminated container."""
    on = rule.get("onExitCodes")
    code = a.exit_code or 0
    if not on or a.lost or code == 0 or on.get("containerName", container) != container:
        return False
    return (code in on["values"]) == (on["operator"] == "In")


def _matches_conditions(rule: dict[str, Any], attempt: Attempt) -> bool:
    for cond in rule.get("onPodConditions") or []:
        if cond["type"] == "DisruptionTarget" and str(cond.get("status", "True")) == "True" and attempt.disrupted:
            return True
    return False


def pod_failure_action(policy: Optional[dict[str, Any]], container: str, attempt: Attempt) -> tuple[str, str]:
    """(action, the Job controller's message) of the first podFailurePolicy rule that
    matches a failed pod; ("Count", "") when none does (pod_failure_policy.go,
    matchPodFailurePolicy, whose messages the JobSet's rules match)."""
    for i, rule in enumerate((policy or {}).get("rules", [])):
        if _matches_exit_codes(rule, container, attempt):
            return rule["action"], (f"Container {container} for pod {attempt.name} failed with exit code "
                                    f"{attempt.exit_code} matching {rule['action']} rule at index {i}")  # fmt: skip
        if _matches_conditions(rule, attempt):
            return rule["action"], f"Pod {attempt.name} has condition DisruptionTarget matching {rule['action']} rule at index {i}"
    return "Count", ""


class JobRules:
    """The Job controller's bookkeeping for one batch/v1 Job (Indexed, restartPolicy Never):
    what a pod's end means for the Job. A pod still Terminating (its node lost) is not
    failed yet: with a podFailurePolicy the controller replaces a pod only once it is
    terminal (podReplacementPolicy Failed), which for a lost node is when PodGC marks it."""

    def __init__(self, spec: dict[str, Any], nodes: int, container: str) -> None:
        self.spec, self.nodes, self.container = spec, nodes, container
        self.succeeded: set[int] = set()
        self.counted = {i: 0 for i in range(nodes)}  # failures counted per index
        self.all_failures = {i: 0 for i in range(nodes)}  # ignored ones too: the delay counts them

    def pod_ended(self, a: Attempt) -> tuple[str, str, float]:
        """("complete" | "running" | "replace" | "failed", why, delay before a replacement)."""
        if a.exit_code == 0 and not a.lost:
            self.succeeded.add(a.index)
            return ("complete" if len(self.succeeded) == self.nodes else "running"), "", 0.0
        action, message = pod_failure_action(self.spec.get("podFailurePolicy"), self.container, a)
        self.all_failures[a.index] += 1
        if action == "FailJob":
            a.note = message
            return "failed", f"PodFailurePolicy: {message}", 0.0
        if action != "Ignore":
            self.counted[a.index] += 1
            per_index = self.spec.get("backoffLimitPerIndex")
            if per_index is not None and self.counted[a.index] > per_index:
                failed = sum(1 for i in self.counted if self.counted[i] > per_index)
                if failed > self.spec.get("maxFailedIndexes", self.nodes):
                    return "failed", "MaxFailedIndexesExceeded", 0.0
                return "running", f"index {a.index} failed", 0.0
            if per_index is None and sum(self.counted.values()) > self.spec.get("backoffLimit", 6):
                return "failed", "BackoffLimitExceeded: Job has reached the specified backoff limit", 0.0
        why = "ignored (podFailurePolicy)" if action == "Ignore" else f"failure {self.counted[a.index]} counted"
        return "replace", why, self._delay(a.index)

    def _delay(self, index: int) -> float:
        """backoff_utils.go, getRemainingTimeForFailuresCount: 10 s doubling per failure
        (ignored ones too), at most 10 minutes; per index with backoffLimitPerIndex, else over
        the whole Job. Counted here from the pod's end (the source counts from its finish
        time, which for a pod GC'd off a lost node can be earlier: the longer wait)."""
        per_index = "backoffLimitPerIndex" in self.spec
        failures = self.all_failures[index] if per_index else sum(self.all_failures.values())
        return min(10.0 * 2 ** (failures - 1), 600.0) if failures else 0.0


class IndexedJob(Controller):
    """batch/v1 Job, completionMode Indexed, restartPolicy Never."""

    def __init__(self, job: dict[str, Any], endpoint: Optional[str], **kw) -> None:
        spec = job["spec"]
        (container,) = spec["template"]["spec"]["containers"]
        template = PodTemplate(container["name"], container.get("command", []) + container.get("args", []),
                               container.get("env", []),
                               float(spec["template"]["spec"].get("terminationGracePeriodSeconds", 30)))  # fmt: skip
        super().__init__(template=template, nodes=int(spec["completions"]), **kw)
        self.endpoint = endpoint
        self.job = JobRules(spec, self.nodes, container["name"])

    def pod_env(self, index: int, rendezvous: str):
        return {"labels": {}, "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}, {}

    def on_exit(self, a: Attempt) -> None:
        if self.outcome is not None and a.exit_code != 0:
            return
        state, why, delay = self.job.pod_ended(a)
        if state == "complete":
            self.finish("complete", "job complete")
        elif state == "failed":
            self.finish(f"failed ({why})", "job failed")
        elif state == "replace":
            self.restarts += 1
            self.replace(a.index, delay, why)
        elif why:
            self.say(f"pod {a.index}: {why}")


# -- Kubeflow Training Operator v1.9.0 ---------------------------------------------------


class PyTorchJob(Controller):
    """PyTorchJob with Worker replicas and an elasticPolicy.

    - A pod that is gone (deleted by an eviction or by PodGC) is created again
      (common/pod.go, ReconcilePods: an empty pod slice).
    - A Failed pod under restartPolicy ExitCode: exit code >= 128 (IsRetryableExitCode,
      pkg/util/train/train_util.go) is deleted and recreated at once, without counting;
      1-127 fails the job. OnFailure/Always restart the container in place.
    - runPolicy.backoffLimit: ``exceedsBackoffLimit`` (common/job.go) compares the workqueue's
      requeue count, always 0 here (FakeWorkQueue.NumRequeues), plus 1 with the limit: only
      0 acts, failing the job at the first Failed pod, a preemption included;
      ``PastBackoffLimit`` (pkg/core/job.go) sums container restarts of Running pods, which
      only restarts in place make. So under ExitCode a limit of 1 or more does nothing: an
      exit >= 128 (an OOM kill is 137) is recreated forever.
    - With an elasticPolicy the job Succeeds as soon as one worker exits 0
      (pytorchjob_controller.go, UpdateJobStatus); cleanPodPolicy Running then deletes the
      others.
    """

    def __init__(self, job: dict[str, Any], **kw) -> None:
        spec = job["spec"]
        self.name = job["metadata"]["name"]
        worker = spec["pytorchReplicaSpecs"]["Worker"]
        pod = worker["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        template = PodTemplate("pytorch", container.get("command", []) + container.get("args", []),
                               container.get("env", []), float(pod.get("terminationGracePeriodSeconds", 30)))  # fmt: skip
        super().__init__(template=template, nodes=int(worker["replicas"]), **kw)
        self.restart_policy = worker.get("restartPolicy", "OnFailure")
        self.elastic = spec.get("elasticPolicy") or {}
        self.nproc = str(spec.get("nprocPerNode", "auto"))
        self.backoff_limit = (spec.get("runPolicy") or {}).get("backoffLimit")
        self.clean = (spec.get("runPolicy") or {}).get("cleanPodPolicy", "None")
        self.in_place = 0  # container restarts in place (OnFailure/Always): what PastBackoffLimit sums

    def pod_env(self, index: int, rendezvous: str):
        e = self.elastic
        extra = {
            "PYTHONUNBUFFERED": "1",
            "PET_RDZV_ENDPOINT": rendezvous,  # {name}-worker-0:23456
            "PET_RDZV_BACKEND": e.get("rdzvBackend", "c10d"),
            "PET_NNODES": f"{e.get('minReplicas', self.nodes)}:{e.get('maxReplicas', self.nodes)}",
            "PET_NPROC_PER_NODE": self.nproc,
        }
        if e.get("maxRestarts") is not None:
            extra["PET_MAX_RESTARTS"] = str(e["maxRestarts"])
        if e.get("rdzvConf"):
            extra["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in e["rdzvConf"])
        labels = {"training.kubeflow.org/replica-index": str(index), "training.kubeflow.org/replica-type": "worker"}
        return {"labels": labels, "annotations": {}}, extra

    def on_exit(self, a: Attempt) -> None:
        if self.outcome is not None:
            return
        if (a.exit_code != 0 or a.lost) and self.backoff_limit == 0:  # a new Failed pod, one fewer active
            return self.finish("failed (BackoffLimitExceeded: backoffLimit 0 and a Failed pod)", "job failed")
        if a.disrupted:  # evicted, or deleted with its lost node: recreated whatever its exit code
            self.restarts += 1
            return self.replace(a.index, 0.0, "pod disrupted (DisruptionTarget)")
        if a.exit_code == 0:
            if self.elastic or all(x and x[-1].exit_code == 0 for x in self.attempts.values()):
                return self.finish("complete", f"job succeeded: cleanPodPolicy {self.clean}", after_s=1.0)
            return
        if self.restart_policy == "ExitCode":
            if a.exit_code >= 128:
                self.restarts += 1
                return self.replace(a.index, 0.0, f"exit code {a.exit_code} is retryable (ExitCode)")
            return self.finish(f"failed (exit code {a.exit_code} is not retryable)", "job failed")
        if self.restart_policy in ("OnFailure", "Always"):
            self.in_place += 1
            if self.backoff_limit is not None and self.in_place >= max(self.backoff_limit, 1):
                return self.finish("failed (BackoffLimitExceeded)", "job failed")
            self.restarts += 1
            return self.replace(a.index, 0.0, f"container restarted in place ({self.in_place} counted)")
        self.finish(f"failed (exit code {a.exit_code}, restartPolicy Never)", "job failed")

    def finish(self, outcome: str, delete_why: str, after_s: float = 0.0) -> None:
        if self.outcome is None and self.clean == "None":
            self.outcome = outcome
            self.say(f"job: {outcome} (cleanPodPolicy None: other pods keep running)")
            self.pending.clear()
            return
        super().finish(outcome, delete_why, after_s)


# -- JobSet v0.12.0 (Kubeflow Trainer v2.3.0) ---------------------------------------------


class JobSet(Controller):
    """A TrainJob's JobSet, from the TrainingRuntime in the bundle: one Indexed Job of
    ``numNodes`` pods and the JobSet's failure policy.

    - The Job applies its podFailurePolicy and backoffLimit (:class:`JobRules`); a Job that
      fails deletes its other pods.
    - failure_policy.go: the first rule matching the failed Job's reason and message
      (``onJobFailureMessagePatterns`` are regular expressions on the Job controller's
      message) acts: FailJobSet; RestartJobSet, counted against maxRestarts (then
      ReachedMaxRestarts); RestartJobSetAndIgnoreMaxRestarts, not counted; no rule matching
      restarts, counted. A restart has no delay.
    - jobset_controller.go, deleteJobs: the old Jobs are deleted in the foreground, and the
      new ones, of the same names, can only be created once every old pod is gone (a pod on
      a lost node only when PodGC deletes it).
    - jobset_controller.go, getChildJobs: Jobs labelled with an earlier restart attempt are
      only deleted, never counted: a pod of the previous run that ends after the restart
      (two pods ending together) is no failure of the new run's Job.
    """

    def __init__(self, trainjob: dict[str, Any], runtime: dict[str, Any], **kw) -> None:
        trainer = trainjob["spec"]["trainer"]
        jobset = runtime["spec"]["template"]["spec"]
        (rjob,) = [r for r in jobset["replicatedJobs"] if r["name"] == "node"]
        self.job = rjob["template"]["spec"]
        pod = self.job["template"]["spec"]
        template = PodTemplate("node", trainer.get("command", []) + trainer.get("args", []), trainer.get("env", []),
                               float(pod.get("terminationGracePeriodSeconds", 30)))  # fmt: skip
        super().__init__(template=template, nodes=int(trainer["numNodes"]), **kw)
        self.nproc = str(trainer.get("numProcPerNode", "auto"))
        self.policy = jobset.get("failurePolicy")
        self.counted_restarts = 0
        self._new_job()

    def _new_job(self) -> None:
        self.job_rules = JobRules(self.job, self.nodes, "node")
        self.job_failure: Optional[tuple[str, str]] = None  # (reason, message) once the Job fails
        self.previous_run = {id(a) for attempts in self.attempts.values() for a in attempts}

    def pod_env(self, index: int, rendezvous: str):
        host, _, port = rendezvous.rpartition(":")
        extra = {
            "PET_NNODES": str(self.nodes),
            "PET_NPROC_PER_NODE": self.nproc,
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": host,  # {trainjob}-node-0-0.{trainjob}
            "PET_MASTER_PORT": port,
        }
        return {"labels": {}, "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}, extra

    def on_exit(self, a: Attempt) -> None:
        if self.outcome is not None or id(a) in self.previous_run:
            return
        if self.job_failure is None:
            state, why, delay = self.job_rules.pod_ended(a)
            if state == "complete":
                return self.finish("complete", "JobSet completed")
            if state == "replace":
                self.restarts += 1
                self.replace(a.index, delay, why)
            elif state == "failed":
                reason, _, message = why.partition(": ")
                self.job_failure = (reason, message)
                self.say(f"job node: failed ({why})")
                self.terminate_active("its Job failed")
        if self.job_failure is not None and not self.pods.live:
            self._job_failed(*self.job_failure)

    def _job_failed(self, reason: str, message: str) -> None:
        if not self.policy:
            return self.finish("failed (FailedJobs)", "JobSet failed")
        action = "RestartJobSet"
        for rule in self.policy.get("rules", []):
            reasons, patterns = rule.get("onJobFailureReasons") or [], rule.get("onJobFailureMessagePatterns") or []
            if reasons and reason not in reasons:
                continue
            if patterns and not any(re.search(p, message) for p in patterns):
                continue
            action = rule["action"]
            self.say(f"JobSet failurePolicy: rule {rule.get('name', '?')!r}: {action}")
            break
        if action == "FailJobSet":
            return self.finish(f"failed (FailJobSetFailurePolicyAction: {reason})", "JobSet failed")
        if action == "RestartJobSet":
            if self.counted_restarts >= self.policy.get("maxRestarts", 0):
                return self.finish("failed (ReachedMaxRestarts)", "JobSet failed")
            self.counted_restarts += 1
        self.restarts += 1
        self.say(f"JobSet: restart {self.restarts} ({'counted' if action == 'RestartJobSet' else 'not counted'})")
        self._new_job()
        for index in range(self.nodes):
            self.pending[index] = 0.0


def build_controller(docs: list[dict[str, Any]], launcher: str, **kw) -> Controller:
    by_kind = {d["kind"]: d for d in docs}
    if launcher == "job":
        job = by_kind["Job"]
        svc = by_kind.get("Service")  # none for a preprocessing job: its pods never talk
        endpoint = f"{job['metadata']['name']}-0.{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}" if svc else None
        return IndexedJob(job, endpoint, **kw)
    if launcher == "pytorchjob":
        return PyTorchJob(by_kind["PyTorchJob"], **kw)
    return JobSet(by_kind["TrainJob"], by_kind["TrainingRuntime"], **kw)
