"""``torchrec-cloud rehearse``: a rendered job's pods run on this machine, as its controller
would run them, with the faults a cluster brings. Rehearse here before paying for GPUs::

    torchrec-cloud rehearse --launcher job --nodes 2 --preempt 1@20 -- --num_epochs 2
    torchrec-cloud rehearse --launcher trainjob --nodes 3 --kill 0@15 --json -- --batch_size 1024

The bundle is the one ``render`` writes for the same flags, with this machine's folders as
the run's output and checkpoint destination (``--output``). Each pod's container command
runs as a process group of its own with the pod's environment: downward-API values and
the variables the operator sets (``PET_*``), then Kubernetes' ``$(VAR)`` expansion. What
one host changes: pod 0's DNS name becomes 127.0.0.1 on a free port, each pod's metrics
endpoint moves to a free port on 127.0.0.1, pods run on CPU with gloo, pinned to one core
each (pod i on core i mod cores), and they do not share /dev/shm (``TORCHREC_CLOUD_SHM=0``)
as pods on different nodes cannot.

The controller's rules are replayed from the rendered objects (sources read: Kubernetes'
Job controller, Training Operator v1.9, Kubeflow Trainer v2.3 with JobSet v0.12; see
docs/deploy.md, "Preemption"):

* ``job``: Indexed Job. A failed pod is matched against the podFailurePolicy rules in
  order (Ignore, FailJob, else Count); counted failures against backoffLimitPerIndex /
  maxFailedIndexes (or backoffLimit); a replacement after the controller's delay, 10 s
  doubling per failure of that index, ignored ones included (``--delay_scale`` shrinks it);
  a succeeded index is never run again; Complete once every index succeeded.
* ``pytorchjob``: elastic Worker replicas. A preempted pod is recreated; with
  restartPolicy ExitCode an exit code of 128 or more recreates the pod, 1-127 fails the
  job; OnFailure restarts it in place and counts against backoffLimit; the job Succeeds
  as soon as one worker exits 0; cleanPodPolicy Running then deletes the others.
* ``trainjob``: the TrainingRuntime's JobSet. Its one Job applies its podFailurePolicy
  and backoffLimit; a failed Job goes through the JobSet's failurePolicy rules (reasons,
  message patterns; RestartJobSet counted against maxRestarts, RestartJobSetAndIgnoreMaxRestarts
  not, FailJobSet), a restart recreating every pod.

Faults: ``--preempt POD@STEP`` gives pod POD the DisruptionTarget condition and SIGTERM
once the run has logged step STEP (a spot reclaim or a drain), and SIGKILL after the
rendered terminationGracePeriodSeconds; ``--kill POD@STEP`` SIGKILLs every process of the
pod (an OOM kill, a lost node). Every fault fires once. Exit code 0 when the job
completes as its controller would see it; ``--json`` ends with one JSON object
(``completed``, ``pods``, ``restarts``, ``final``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

from torchrec_cloud.config import ConfigError, respelled

POLL_S = 0.05
_MARKER = "TORCHREC_CLOUD_REHEARSAL_POD"
SCRAPE_EVERY_S = 0.5


# -- pods as processes -------------------------------------------------------------------


@dataclasses.dataclass
class PodTemplate:
    """What the controller starts for one pod: the container and the pod's terminating rules."""

    container: str  # name, for podFailurePolicy's containerName
    command: list[str]
    env: list[dict[str, Any]]  # Kubernetes env entries (value or valueFrom.fieldRef)
    grace_s: float


@dataclasses.dataclass
class Attempt:
    """One pod object: a process group, its log, and what happened to it."""

    index: int
    number: int
    proc: subprocess.Popen
    started: float
    log: Path
    metrics_port: Optional[int]
    marker: bytes  # in the environment of every process of this pod
    disrupted: bool = False  # the DisruptionTarget condition (preempted, evicted)
    deleting: bool = False  # SIGTERM sent by the "kubelet"; SIGKILL at kill_at
    kill_at: Optional[float] = None
    exit_code: Optional[int] = None
    note: str = ""

    @property
    def name(self) -> str:
        return f"pod {self.index} (attempt {self.number})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``, the
    rest stays as written."""

    def sub(m: re.Match) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def resolve_env(entries: list[dict[str, Any]], metadata: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's env list as the kubelet makes it: values expanded against the ones
    before them, fieldRefs read from the pod's labels and annotations."""
    env: dict[str, str] = {}
    for item in entries:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if not m or m.group(2) not in metadata[m.group(1)]:
            raise ConfigError("launcher", f"the rehearsal cannot resolve the downward-API field {path}")
        env[item["name"]] = metadata[m.group(1)][m.group(2)]
    return env


def _local_argv(argv: list[str], endpoint: Optional[str], rendezvous: str) -> tuple[list[str], Optional[int]]:
    """The pod's argv on this host: the rendezvous endpoint on 127.0.0.1, the metrics
    endpoint on a free port of 127.0.0.1, kept for a second after the run (the rehearsal's
    scrapes, not a collector's interval)."""
    out: list[str] = []
    port = None
    for i, arg in enumerate(argv):
        if endpoint:
            arg = arg.replace(endpoint, rendezvous)
        previous = argv[i - 1] if i else ""
        if previous == "--prometheus_port":
            port = free_port()
            out += [str(port), "--metrics_host", "127.0.0.1"]
            continue
        out.append("1" if previous == "--prometheus_linger" else arg)
    return out, port


class Pods:
    """Starts and stops the pods' processes, each in its own session, one core each."""

    def __init__(self, folder: Path, base_env: dict[str, str], say: Callable[[str], None]) -> None:
        self.folder = folder
        self.base_env = base_env
        self.say = say
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.counts: dict[int, int] = {}
        self.live: list[Attempt] = []

    def start(self, index: int, template: PodTemplate, metadata: dict[str, dict[str, str]],
              extra_env: dict[str, str], endpoint: Optional[str], rendezvous: str) -> Attempt:  # fmt: skip
        env = {**resolve_env(template.env, metadata), **extra_env}
        argv = [expand(a, env) for a in template.command]
        argv, metrics_port = _local_argv(argv, endpoint, rendezvous)
        number = self.counts[index] = self.counts.get(index, 0) + 1
        log = self.folder / f"pod-{index}-attempt-{number}.log"
        # torchrun starts each worker in a session of its own, so a pod's processes are found
        # by a variable they all inherit, as a container's are by its cgroup.
        marker = f"{os.getpid()}-{index}-{number}"
        env[_MARKER] = marker
        core = {self.cores[index % len(self.cores)]} if self.cores else None

        def pin() -> None:
            if core:
                os.sched_setaffinity(0, core)

        with open(log, "w") as out:
            proc = subprocess.Popen(
                argv, env={**self.base_env, **env}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin,
            )  # fmt: skip
        attempt = Attempt(index, number, proc, time.monotonic(), log, metrics_port, f"{_MARKER}={marker}".encode())
        self.live.append(attempt)
        self.say(f"{attempt.name}: started (pid {proc.pid})")
        return attempt

    def delete(self, attempt: Attempt, grace_s: float, why: str, disrupted: bool = False) -> None:
        """The kubelet's termination: SIGTERM to the container's first process, SIGKILL to
        all of the pod's processes after the grace period."""
        if attempt.exit_code is not None or attempt.deleting:
            return
        attempt.deleting, attempt.disrupted = True, attempt.disrupted or disrupted
        attempt.kill_at = time.monotonic() + grace_s
        attempt.note = why
        self.say(f"{attempt.name}: {why}: SIGTERM (grace {grace_s:g} s)")
        try:
            attempt.proc.send_signal(signal.SIGTERM)  # the container's first process only
        except ProcessLookupError:
            pass

    def kill(self, attempt: Attempt, why: str) -> None:
        attempt.note = why
        self.say(f"{attempt.name}: {why}: SIGKILL to every process of the pod")
        _kill_pod(attempt)

    def reap(self) -> list[Attempt]:
        """Attempts whose process ended since the last call (SIGKILLing those past their grace)."""
        now, ended = time.monotonic(), []
        for attempt in list(self.live):
            code = attempt.proc.poll()
            if code is None:
                if attempt.kill_at is not None and now >= attempt.kill_at:
                    self.kill(attempt, "grace period over")
                    attempt.kill_at = None
                continue
            # The pod's other processes go with its first one, as with a container.
            _kill_pod(attempt)
            attempt.exit_code = code if code >= 0 else 128 - code
            self.live.remove(attempt)
            ended.append(attempt)
        return ended

    def stop_all(self) -> None:
        for attempt in list(self.live):
            _kill_pod(attempt)
            attempt.proc.wait()
            attempt.exit_code = attempt.exit_code if attempt.exit_code is not None else 137
        self.live.clear()


def _kill_pod(attempt: Attempt) -> None:
    """SIGKILL every process that carries the pod's marker in its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if attempt.marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
    try:
        attempt.proc.kill()
    except ProcessLookupError:
        pass


# -- the controllers ---------------------------------------------------------------------


def _matches_exit_codes(rule: dict[str, Any], container: str, code: int) -> bool:
    on = rule.get("onExitCodes")
    if not on or code == 0 or on.get("containerName", container) != container:
        return False
    return (code in on["values"]) == (on["operator"] == "In")


def _matches_conditions(rule: dict[str, Any], attempt: Attempt) -> bool:
    for cond in rule.get("onPodConditions") or []:
        if cond["type"] == "DisruptionTarget" and str(cond.get("status", "True")) == "True" and attempt.disrupted:
            return True
    return False


def pod_failure_action(policy: Optional[dict[str, Any]], container: str, attempt: Attempt) -> tuple[str, str]:
    """(action, the Job controller's message) of the first podFailurePolicy rule that
    matches a failed pod; ("Count", "") when none does."""
    code = attempt.exit_code or 0
    for i, rule in enumerate((policy or {}).get("rules", [])):
        if _matches_exit_codes(rule, container, code):
            return rule["action"], (f"Container {container} for pod {attempt.name} failed with exit code "
                                    f"{code} matching {rule['action']} rule at index {i}")  # fmt: skip
        if _matches_conditions(rule, attempt):
            return rule["action"], f"Pod {attempt.name} has condition DisruptionTarget matching {rule['action']} rule at index {i}"
    return "Count", ""


class Controller:
    """What the launcher's controller does with its pods; subclasses fill in the rules."""

    def __init__(self, pods: Pods, template: PodTemplate, nodes: int, say: Callable[[str], None],
                 delay_scale: float) -> None:  # fmt: skip
        self.pods = pods
        self.template = template
        self.nodes = nodes
        self.say = say
        self.delay_scale = delay_scale
        self.rendezvous_port = free_port()
        self.attempts: dict[int, list[Attempt]] = {i: [] for i in range(nodes)}
        self.current: dict[int, Optional[Attempt]] = {i: None for i in range(nodes)}
        self.pending: dict[int, float] = {i: 0.0 for i in range(nodes)}  # index -> start not before
        self.outcome: Optional[str] = None  # "complete" or the failure's reason
        self.restarts = 0
        self._delete_at: Optional[tuple[float, str]] = None

    # what a subclass provides
    endpoint: Optional[str] = None

    def pod_env(self, index: int) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
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
            self.delete_active(self._delete_at[1])
            self._delete_at = None
        for index, not_before in list(self.pending.items()):
            if now >= not_before and self.outcome is None:
                del self.pending[index]
                metadata, extra = self.pod_env(index)
                attempt = self.pods.start(index, self.template, metadata, extra, self.endpoint,
                                          f"127.0.0.1:{self.rendezvous_port}")  # fmt: skip
                self.attempts[index].append(attempt)
                self.current[index] = attempt
        for attempt in self.pods.reap():
            self.current[attempt.index] = None
            self.say(f"{attempt.name}: exited {attempt.exit_code}")
            self.on_exit(attempt)

    def replace(self, index: int, delay_s: float = 0.0, why: str = "") -> None:
        delay_s *= self.delay_scale
        self.pending[index] = time.monotonic() + delay_s
        self.say(f"pod {index}: {why}; replaced" + (f" in {delay_s:.1f} s" if delay_s else ""))

    def delete_active(self, why: str) -> None:
        for attempt in list(self.pods.live):
            self.pods.delete(attempt, self.template.grace_s, why)
        self.pending.clear()

    def finish(self, outcome: str, delete_why: str, after_s: float = 0.0) -> None:
        """The job's end; the pods still running are deleted (after ``after_s``: the
        controller's next reconcile)."""
        if self.outcome is None:
            self.outcome = outcome
            self.say(f"job: {outcome}")
            self.pending.clear()
            self._delete_at = (time.monotonic() + after_s, delete_why)


class JobRules:
    """The Job controller's bookkeeping for one batch/v1 Job (Indexed, restartPolicy Never):
    what a pod's end means for the Job."""

    def __init__(self, spec: dict[str, Any], nodes: int, container: str) -> None:
        self.spec, self.nodes, self.container = spec, nodes, container
        self.succeeded: set[int] = set()
        self.counted = {i: 0 for i in range(nodes)}  # failures counted per index
        self.all_failures = {i: 0 for i in range(nodes)}  # ignored ones too: the delay counts them

    def pod_ended(self, a: Attempt) -> tuple[str, str, float]:
        """("complete" | "running" | "replace" | "failed", why, delay before a replacement)."""
        if a.exit_code == 0:
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
        """10 s doubling per failure (ignored ones too), at most 10 minutes; per index with
        backoffLimitPerIndex, else over the whole Job."""
        per_index = "backoffLimitPerIndex" in self.spec
        failures = self.all_failures[index] if per_index else sum(self.all_failures.values())
        return min(10.0 * 2 ** (failures - 1), 600.0) if failures else 0.0


class IndexedJob(Controller):
    """batch/v1 Job, completionMode Indexed, restartPolicy Never."""

    def __init__(self, job: dict[str, Any], endpoint: str, **kw) -> None:
        spec = job["spec"]
        (container,) = spec["template"]["spec"]["containers"]
        template = PodTemplate(container["name"], container.get("command", []) + container.get("args", []),
                               container.get("env", []),
                               float(spec["template"]["spec"].get("terminationGracePeriodSeconds", 30)))  # fmt: skip
        super().__init__(template=template, nodes=int(spec["completions"]), **kw)
        self.endpoint = endpoint
        self.job = JobRules(spec, self.nodes, container["name"])

    def pod_env(self, index: int):
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


class PyTorchJob(Controller):
    """Training Operator v1 PyTorchJob with Worker replicas and an elasticPolicy."""

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
        self.in_place = 0  # container restarts in place (OnFailure/Always): what backoffLimit counts

    def pod_env(self, index: int):
        e = self.elastic
        extra = {
            "PYTHONUNBUFFERED": "1",
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{self.rendezvous_port}",  # {name}-worker-0:23456
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
        if a.disrupted:  # evicted: the pod object is gone, and a missing pod is recreated
            self.restarts += 1
            return self.replace(a.index, 0.0, "pod deleted (preempted)")
        if a.exit_code == 0:
            if self.elastic or all(x and x[-1].exit_code == 0 for x in self.attempts.values()):
                # elasticPolicy: one succeeded worker makes the job Succeeded.
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


class JobSet(Controller):
    """A TrainJob's JobSet, from the TrainingRuntime in the bundle: one Indexed Job of
    ``numNodes`` pods and the JobSet's failure policy."""

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

    def pod_env(self, index: int):
        extra = {
            "PET_NNODES": str(self.nodes),
            "PET_NPROC_PER_NODE": self.nproc,
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": "127.0.0.1",  # {trainjob}-node-0-0.{trainjob}
            "PET_MASTER_PORT": str(self.rendezvous_port),
        }
        return {"labels": {}, "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}, extra

    def on_exit(self, a: Attempt) -> None:
        if self.outcome is not None:
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
                self.delete_active("its Job failed")
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


# -- the rehearsal -----------------------------------------------------------------------


@dataclasses.dataclass
class Fault:
    kind: str  # "preempt" or "kill"
    pod: int
    step: int
    fired: bool = False

    @classmethod
    def parse(cls, kind: str, text: str, nodes: int) -> "Fault":
        m = re.fullmatch(r"(\d+)@(\d+)", text.strip())
        if not m:
            raise ConfigError(kind, f"must be POD@STEP (e.g. 1@20), got {text!r}")
        pod, step = int(m.group(1)), int(m.group(2))
        if pod >= nodes:
            raise ConfigError(kind, f"pod {pod} does not exist: the job has pods 0..{nodes - 1}")
        return cls(kind, pod, step)


class Progress:
    """The latest training step the run has logged (rank 0's metrics.jsonl)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.step = -1

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.step
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "train":
                self.step = int(record["step"])
        return self.step


def _scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
            return b"\ntorchrec_train_step{" in r.read()
    except OSError:
        return False


def _flag_value(args: list[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_controller(docs: list[dict[str, Any]], launcher: str, **kw) -> Controller:
    by_kind = {d["kind"]: d for d in docs}
    if launcher == "job":
        job = by_kind["Job"]
        svc = by_kind["Service"]
        endpoint = f"{job['metadata']['name']}-0.{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
        return IndexedJob(job, endpoint, **kw)
    if launcher == "pytorchjob":
        return PyTorchJob(by_kind["PyTorchJob"], **kw)
    return JobSet(by_kind["TrainJob"], by_kind["TrainingRuntime"], **kw)


def rehearse(spec, faults: list[Fault], output: Path, timeout_s: float, delay_scale: float,
             say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Render ``spec``, run its pods under its controller's rules with ``faults``; the report."""
    from torchrec_cloud.deploy.manifests import load_documents, render_bundle

    bundle = render_bundle(spec)
    (output / "manifests.yaml").write_text(bundle)
    docs = load_documents(bundle)
    pods_dir = output / "pods"
    pods_dir.mkdir(parents=True, exist_ok=True)
    base_env = {
        **os.environ,
        # The image puts its virtualenv first on PATH, with the package installed.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "TORCHREC_CLOUD_SHM": "0",  # pods on different nodes share no /dev/shm
    }
    pods = Pods(pods_dir, base_env, say)
    controller = build_controller(docs, spec.launcher, pods=pods, say=say, delay_scale=delay_scale)
    run_dir = Path(_flag_value(spec.trainer_args("/unused"), "--output_dir") or "")
    progress = Progress(run_dir / "metrics.jsonl")
    served = {i: False for i in range(spec.nodes)}
    deadline = time.monotonic() + timeout_s
    last_scrape = 0.0
    timed_out = False
    try:
        while not controller.finished:
            if time.monotonic() > deadline:
                timed_out = True
                say(f"timed out after {timeout_s:g} s")
                break
            controller.tick()
            step = progress.poll()
            for fault in faults:
                target = controller.current.get(fault.pod)
                if fault.fired or step < fault.step or target is None or target.deleting:
                    continue
                fault.fired = True
                if fault.kind == "preempt":
                    pods.delete(target, controller.template.grace_s, f"preempted at step {step}", disrupted=True)
                else:
                    pods.kill(target, f"killed at step {step}")
            if time.monotonic() - last_scrape > SCRAPE_EVERY_S:
                last_scrape = time.monotonic()
                for a in pods.live:
                    if a.metrics_port and not served[a.index] and not a.deleting:
                        served[a.index] = _scrape(a.metrics_port)
            time.sleep(POLL_S)
    finally:
        pods.stop_all()
    return _report(spec, controller, faults, served, run_dir, timed_out, output)


def _report(spec, controller: Controller, faults, served, run_dir: Path, timed_out: bool, output: Path) -> dict:
    records = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    final: dict[str, Any] = {}
    for split in ("val", "test"):
        evals = [r for r in records if r.get("event") == "eval" and r.get("split") == split]
        if evals:
            final[f"{split}_auc"], final[f"{split}_logloss"] = evals[-1]["auc"], evals[-1]["logloss"]
            final["step"] = evals[-1]["step"]
    ends = [r for r in records if r.get("event") == "end"]
    finished_run = bool(ends) and not ends[-1].get("preempted")
    completed = controller.outcome == "complete" and finished_run and not timed_out
    return {
        "completed": completed,
        "outcome": "timed out" if timed_out else controller.outcome,
        "launcher": spec.launcher,
        "nodes": spec.nodes,
        "pods": [
            {
                "index": i,
                "exit_codes": [a.exit_code for a in controller.attempts[i]],
                "notes": [a.note for a in controller.attempts[i]],
                "logs": [str(a.log) for a in controller.attempts[i]],
                "metrics_served": served[i],
            }
            for i in range(spec.nodes)
        ],
        "restarts": controller.restarts,
        "faults": [dataclasses.asdict(f) for f in faults],
        "final": final,
        "resumes": [r["step"] for r in records if r.get("event") == "resume"],
        "output": str(output),
    }


# -- CLI ---------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    from torchrec_cloud.deploy.spec import add_spec_flags

    parser = subparsers.add_parser(
        "rehearse",
        help="run a rendered job's pods on this machine under its controller's rules, with faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc_per_node", type=int, default=1, help="trainer processes per pod (default: 1)")
    parser.add_argument("--preempt", action="append", default=[], metavar="POD@STEP",
                        help="SIGTERM pod POD (DisruptionTarget) once step STEP is logged; repeatable")
    parser.add_argument("--kill", action="append", default=[], metavar="POD@STEP",
                        help="SIGKILL every process of pod POD once step STEP is logged; repeatable")
    parser.add_argument("--output", metavar="DIR",
                        help="an empty or new folder for the run, its checkpoints, the pods' logs "
                             "(default: runs/rehearse/NAME-TIME)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600, help="give up after this many seconds (default: 3600)")
    parser.add_argument("--delay_scale", type=float, default=1.0,
                        help="multiply the controllers' retry delays (default: 1, as the Job controller)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object of what happened")
    add_spec_flags(parser, exclude=("gpus_per_node", "procs_per_node", "instance_type"))
    parser.set_defaults(func=run)
    return parser


def _output_folder(ns: argparse.Namespace) -> Path:
    if ns.output:
        out = Path(ns.output).resolve()
        if out.exists() and any(out.iterdir()):
            raise ConfigError("output", f"{out} is not empty (a rehearsal would resume from what is there)")
    else:
        out = Path("runs", "rehearse", f"{ns.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(ns: argparse.Namespace) -> int:
    from torchrec_cloud.deploy.spec import spec_from_args, trainer_flags

    if ns.nproc_per_node < 1:
        raise ConfigError("nproc_per_node", f"must be >= 1, got {ns.nproc_per_node}")
    faults = [Fault.parse("preempt", f, ns.nodes) for f in ns.preempt] + [Fault.parse("kill", f, ns.nodes) for f in ns.kill]
    output = _output_folder(ns)
    ns.train_args = respelled(ns.train_args or [], trainer_flags())  # `--output-dir` is `--output_dir`
    ns.gpus_per_node, ns.procs_per_node, ns.instance_type = 0, ns.nproc_per_node, None
    if not ns.checkpoint_url and "--checkpoint_path" not in (ns.train_args or []):
        ns.checkpoint_url = str(output / "checkpoints")
    if "--output_dir" not in (ns.train_args or []):
        ns.train_args = [*(ns.train_args or []), "--output_dir", str(output / "run")]
    spec = spec_from_args(ns)
    start = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {message}", flush=True)

    say(f"rehearsing {spec.launcher} {spec.name}: {spec.nodes} pod(s) x {spec.procs} process(es), output {output}")

    def stop(signum, frame):  # the pods' processes must not outlive the rehearsal
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    report = rehearse(spec, faults, output, ns.timeout, ns.delay_scale, say)
    (output / "rehearsal.json").write_text(json.dumps(report, indent=1))
    for fault in faults:
        if not fault.fired:
            say(f"--{fault.kind} {fault.pod}@{fault.step}: never fired (the run did not log step {fault.step} "
                f"while pod {fault.pod} ran)")  # fmt: skip
    print(f"{'pod':>4}  exit codes (one per attempt)")
    for pod in report["pods"]:
        print(f"{pod['index']:>4}  {' '.join(str(c) for c in pod['exit_codes'])}")
    final = report["final"]
    summary = ", ".join(f"{k} {v:.6f}" for k, v in final.items() if k != "step")
    print(f"{'completed' if report['completed'] else 'NOT completed'} ({report['outcome']}); "
          f"{report['restarts']} restart(s); {summary or 'no evaluation'}")  # fmt: skip
    if ns.json:
        print(json.dumps(report))
    return 0 if report["completed"] else 1
