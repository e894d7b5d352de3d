"""Admission as a cluster does it: the rules the API server and the operators' webhooks
apply to the objects we render, and the versions a bundle needs.

A bundle can pass every schema and still never run: JobSet's validating webhook denies the
JobSet that Kubeflow Trainer makes from a TrainingRuntime whose failure-policy rule name has
a hyphen (the TrainJob itself is accepted, no pod ever appears), and a job name that fits
Kubernetes' 63 characters may not once a controller appends ``-node-0-0-abcde`` to it.
:func:`check` applies those rules; ``manifests.render_bundle`` runs it on every bundle, so
``render``, ``submit`` and ``rehearse`` all refuse such a bundle with one line::

    problems = check(load_documents(text))     # [] when a cluster would admit and run it

Each rule names the file and version it was read from. :data:`MIN_VERSIONS` is what each
launcher's objects need of the cluster; the bundle records it in the workload's
annotations (``torchrec-cloud/min-kubernetes``, ``torchrec-cloud/min-operators``) and
``submit`` compares it with ``kubectl version``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from torchrec_cloud.config import ConfigError

# The oldest versions each launcher's objects work on, with why.
MIN_VERSIONS: dict[str, dict[str, Any]] = {
    "job": {
        "kubernetes": "1.33",
        "operators": "",
        "why": "backoffLimitPerIndex is GA in 1.33 (beta before, and off where its feature gate is: "
               "an API server without it drops the field silently, and every crash counts against "
               "the whole Job); podFailurePolicy and DisruptionTarget are GA in 1.31",
    },
    "pytorchjob": {
        "kubernetes": "1.27",
        "operators": "kubeflow training-operator >= 1.9.0",
        "why": "the Training Operator's README (v1.9.0) supports Kubernetes 1.27+",
    },
    "trainjob": {
        "kubernetes": "1.32",
        "operators": "kubeflow trainer >= 2.3.0, jobset >= 0.12.0",
        "why": "JobSet v0.12.0 supports the latest 3 minor versions (README: tested on 1.32-1.34); "
               "Kubeflow Trainer v2.3.0 needs Kubernetes >= 1.31 (docs/operator-guides/installation.md)",
    },
    "daily": {
        "kubernetes": "1.31",
        "operators": "",
        "why": "the CronJob's Job template takes a podFailurePolicy with the DisruptionTarget condition, GA "
               "in 1.31; CronJob timeZone is GA in 1.27",
    },
    "serve": {
        "kubernetes": "1.30",
        "operators": "",
        "why": "the preStop sleep action (PodLifecycleSleepAction) is on by default from 1.30; "
               "autoscaling/v2 and policy/v1 are older",
    },
    "serve-keda": {
        "kubernetes": "1.30",
        "operators": "keda >= 2.20",
        "why": "the ScaledObject CRD and webhook rules read at kedacore/keda v2.20.1-117 (8b4f083c)",
    },
    "kserve": {
        "kubernetes": "1.30",
        "operators": "kserve >= 0.15 (raw deployment mode)",
        "why": "the InferenceService CRD read at kserve/kserve v0.20.0-rc0-104 (aaac4e29); the pod's "
               "preStop sleep action needs 1.30",
    },
}  # fmt: skip
MIN_KUBERNETES_ANNOTATION = "torchrec-cloud/min-kubernetes"
MIN_OPERATORS_ANNOTATION = "torchrec-cloud/min-operators"

# k8s.io/apimachinery/pkg/util/validation/validation.go (IsDNS1123Label, IsDNS1035Label,
# IsDNS1123Subdomain, IsValidLabelValue): lengths 63, 63, 253, 63.
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

# kubernetes-sigs/jobset v0.12.0 pkg/webhooks/jobset_webhook.go, validateFailurePolicy.
JOBSET_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_JOBSET_RULE_NAME_LENGTH = (1, 128)
_JOBSET_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                           "PodFailurePolicy"}  # validOnJobFailureReasons  # fmt: skip
# kubeflow/trainer v2.3.0 pkg/constants/constants.go, TorchRunReservedEnvNames.
_TORCH_RESERVED_ENVS = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


@dataclasses.dataclass
class Problem:
    """One refusal: the object, the field, what the cluster says, where the rule lives, and
    the flag that changes it (``name`` for generated names, else none: a template's bug)."""

    obj: str
    path: str
    message: str
    source: str
    flag: Optional[str] = None

    def __str__(self) -> str:
        return f"{self.obj} {self.path}: {self.message} ({self.source})"


class AdmissionError(ConfigError):
    """A rendered bundle that a cluster would refuse (or accept and never run)."""

    def __init__(self, problem: Problem) -> None:
        ValueError.__init__(self, f"--{problem.flag}: {problem}" if problem.flag else f"a cluster would refuse {problem}")
        self.flag = problem.flag or "launcher"
        self.problem = problem


def _label(value: str, pattern: re.Pattern, kind: str) -> Optional[str]:
    if len(value) > 63:
        return f"{value!r} is {len(value)} characters, more than the 63 of a {kind}"
    if not pattern.match(value):
        first = "a lower-case letter" if pattern is _DNS1035_LABEL else "a lower-case letter or digit"
        return f"{value!r} is not a {kind} (lower-case letters, digits and '-', starting with {first})"
    return None


def check(docs: list[dict[str, Any]]) -> list[Problem]:
    """Every rule below against every object of a bundle; [] when all pass."""
    problems: list[Problem] = []
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc.get("kind", ""), []).append(doc)
    for doc in docs:
        problems += _names(doc)
    for job in by_kind.get("Job", []):
        problems += _job(job)
    for job in by_kind.get("PyTorchJob", []):
        problems += _pytorchjob(job)
    runtimes = {r["metadata"]["name"]: r for r in by_kind.get("TrainingRuntime", [])}
    for runtime in runtimes.values():
        problems += _trainingruntime(runtime)
    for trainjob in by_kind.get("TrainJob", []):
        runtime = runtimes.get(trainjob["spec"].get("runtimeRef", {}).get("name", ""))
        problems += _trainjob(trainjob, runtime)
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        problems += _hpa(hpa)
    for scaled in by_kind.get("ScaledObject", []):
        problems += _scaledobject(scaled, by_kind.get("HorizontalPodAutoscaler", []))
    return problems


def check_or_raise(docs: list[dict[str, Any]]) -> None:
    problems = check(docs)
    if problems:
        raise AdmissionError(problems[0])


def _names(doc: dict) -> list[Problem]:
    """kubernetes v1.33 pkg/apis/core/validation/validation.go: a Namespace's name is a
    DNS-1123 label (ValidateNamespaceName), a Service's a DNS-1035 label
    (ValidateServiceName); other objects' names are DNS-1123 subdomains."""
    kind, name = doc.get("kind", ""), doc.get("metadata", {}).get("name", "")
    source = "kubernetes v1.33 pkg/apis/core/validation/validation.go"
    if kind == "Namespace":
        why = _label(name, _DNS1123_LABEL, "DNS-1123 label")
    elif kind == "Service":
        why = _label(name, _DNS1035_LABEL, "DNS-1035 label")
    else:
        why = None if len(name) <= 253 and _DNS1123_SUBDOMAIN.match(name) else f"{name!r} is not a DNS-1123 subdomain"
    return [Problem(f"{kind} {name}", "metadata.name", why, source, "name")] if why else []


def _job(job: dict) -> list[Problem]:
    """batch/v1 Job, kubernetes v1.33: the name is the value of the pods'
    ``batch.kubernetes.io/job-name`` label (a label value, 63 characters at most,
    pkg/apis/batch/validation/validation.go); an Indexed Job's pods are named by
    hostname ``<name>-<index>`` (pkg/controller/job/job_controller.go, manageJob), a DNS-1123
    label; a podFailurePolicy needs restartPolicy Never, its onExitCodes a container of the
    pod, and backoffLimitPerIndex completionMode Indexed (validation.go, validateJobSpec)."""
    name, spec = job["metadata"]["name"], job["spec"]
    obj, source = f"Job {name}", "kubernetes v1.33 pkg/apis/batch/validation/validation.go"
    out = []
    if len(name) > 63:
        out.append(Problem(obj, "metadata.name", f"{name!r} is {len(name)} characters: the pods' job-name label "
                                                 "takes at most 63", source, "name"))  # fmt: skip
    pod = spec.get("template", {}).get("spec", {})
    indexed = spec.get("completionMode") == "Indexed"
    if indexed and spec.get("completions"):
        hostname = f"{name}-{int(spec['completions']) - 1}"
        why = _label(hostname, _DNS1123_LABEL, "DNS-1123 label")
        if why:
            out.append(Problem(obj, "spec.template (pod hostname)", why,
                               "kubernetes v1.33 pkg/controller/job/job_controller.go", "name"))  # fmt: skip
    policy = spec.get("podFailurePolicy")
    if policy:
        if pod.get("restartPolicy") != "Never":
            out.append(Problem(obj, "spec.podFailurePolicy", "needs the pod's restartPolicy Never", source))
        containers = {c["name"] for c in pod.get("containers", [])}
        for i, rule in enumerate(policy.get("rules", [])):
            container = (rule.get("onExitCodes") or {}).get("containerName")
            if container is not None and container not in containers:
                out.append(Problem(obj, f"spec.podFailurePolicy.rules[{i}].onExitCodes.containerName",
                                   f"{container!r} is not a container of the pod", source))  # fmt: skip
    for field in ("backoffLimitPerIndex", "maxFailedIndexes"):
        if field in spec and not indexed:
            out.append(Problem(obj, f"spec.{field}", "needs completionMode Indexed", source))
    if "maxFailedIndexes" in spec and "backoffLimitPerIndex" not in spec:
        out.append(Problem(obj, "spec.maxFailedIndexes", "needs backoffLimitPerIndex", source))
    return out


def _pytorchjob(job: dict) -> list[Problem]:
    """kubeflow/training-operator v1.9.0 pkg/webhooks/pytorch/pytorchjob_webhook.go
    (validatePyTorchJob): the name is a DNS-1035 label; an elasticPolicy needs Worker
    replicas, at least 1, with a container named ``pytorch``. The operator names each pod
    and its Service ``<name>-worker-<index>`` (pkg/core/utils.go, GenGeneralName): a Service
    name is a DNS-1035 label."""
    name, spec = job["metadata"]["name"], job["spec"]
    obj, source = f"PyTorchJob {name}", "training-operator v1.9.0 pkg/webhooks/pytorch/pytorchjob_webhook.go"
    out = []
    why = _label(name, _DNS1035_LABEL, "DNS-1035 label")
    if why:
        out.append(Problem(obj, "metadata.name", why, source, "name"))
    worker = (spec.get("pytorchReplicaSpecs") or {}).get("Worker")
    if worker is None:
        if spec.get("elasticPolicy") is not None:
            out.append(Problem(obj, "spec.pytorchReplicaSpecs", "Worker must be configured if elastic policy is used",
                               source))  # fmt: skip
        return out
    replicas = int(worker.get("replicas", 1))
    if replicas < 1:
        out.append(Problem(obj, "spec.pytorchReplicaSpecs.Worker.replicas", "must be at least 1", source))
    names = [c.get("name") for c in worker.get("template", {}).get("spec", {}).get("containers", [])]
    if "pytorch" not in names:
        out.append(Problem(obj, "spec.pytorchReplicaSpecs.Worker.template.spec.containers",
                           "must have at least one container with name pytorch", source))  # fmt: skip
    why = _label(f"{name}-worker-{replicas - 1}", _DNS1035_LABEL, "DNS-1035 label")
    if why:
        out.append(Problem(obj, "metadata.name (its pods' Services)", why,
                           "training-operator v1.9.0 pkg/core/utils.go", "name"))  # fmt: skip
    return out


def _trainingruntime(runtime: dict) -> list[Problem]:
    """kubeflow/trainer v2.3.0 pkg/webhooks/trainingruntime_webhook.go
    (validateReplicatedJobs): the trainer's replicatedJob has 1 replica and a container
    named ``node``; and the JobSet it becomes must pass JobSet's own webhook."""
    name = runtime["metadata"]["name"]
    obj, source = f"TrainingRuntime {name}", "trainer v2.3.0 pkg/webhooks/trainingruntime_webhook.go"
    out = []
    jobset = runtime["spec"]["template"]["spec"]
    for i, rjob in enumerate(jobset.get("replicatedJobs", [])):
        labels = (rjob.get("template", {}).get("metadata") or {}).get("labels") or {}
        if labels.get("trainer.kubeflow.org/trainjob-ancestor-step") != "trainer":
            continue
        path = f"spec.template.spec.replicatedJobs[{i}]"
        if int(rjob.get("replicas", 1)) != 1:
            out.append(Problem(obj, f"{path}.replicas", "must be 1", source))
        names = [c.get("name") for c in rjob["template"]["spec"]["template"]["spec"].get("containers", [])]
        if "node" not in names:
            out.append(Problem(obj, f"{path}...containers", "must have a container named node", source))
    out += _jobset_failure_policy(obj, jobset)
    return out


def _jobset_failure_policy(obj: str, jobset: dict) -> list[Problem]:
    """kubernetes-sigs/jobset v0.12.0 pkg/webhooks/jobset_webhook.go, validateFailurePolicy:
    rule names of 1 to 128 characters matching ``^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$``,
    unique; onJobFailureReasons among the Job controller's failure reasons."""
    source = "jobset v0.12.0 pkg/webhooks/jobset_webhook.go"
    out, seen = [], set()
    for i, rule in enumerate((jobset.get("failurePolicy") or {}).get("rules", [])):
        path = f"spec.template.spec.failurePolicy.rules[{i}]"
        rule_name = rule.get("name", "")
        lo, hi = _JOBSET_RULE_NAME_LENGTH
        if not lo <= len(rule_name) <= hi:
            out.append(Problem(obj, f"{path}.name", f"must be {lo} to {hi} characters", source))
        if not JOBSET_RULE_NAME.match(rule_name):
            out.append(Problem(obj, f"{path}.name", f"{rule_name!r} does not match {JOBSET_RULE_NAME.pattern}: JobSet's "
                                                    "webhook denies the JobSet, and no pod ever starts", source))  # fmt: skip
        if rule_name in seen:
            out.append(Problem(obj, f"{path}.name", f"{rule_name!r} names two rules", source))
        seen.add(rule_name)
        for reason in rule.get("onJobFailureReasons") or []:
            if reason not in _JOBSET_FAILURE_REASONS:
                out.append(Problem(obj, f"{path}.onJobFailureReasons", f"{reason!r} is not a Job failure reason", source))
    return out


def _trainjob(trainjob: dict, runtime: Optional[dict]) -> list[Problem]:
    """The JobSet Kubeflow Trainer v2.3.0 makes for a TrainJob is named after it, with the
    runtime's replicatedJobs, and ``numNodes`` completions for the trainer's Job
    (pkg/runtime/framework/plugins/torch/torch.go). jobset v0.12.0
    pkg/webhooks/jobset_webhook.go: the names of its Jobs (``<jobset>-<rjob>-<index>``) and of
    their pods (``<jobset>-<rjob>-<index>-<pod>`` and 5 random characters,
    pkg/util/placement/placement.go) must be DNS-1035 labels. The torch plugin's Validate
    refuses the PET_ variables it sets itself (TorchRunReservedEnvNames)."""
    name = trainjob["metadata"]["name"]
    obj = f"TrainJob {name}"
    out = []
    trainer = trainjob["spec"].get("trainer") or {}
    reserved = sorted({e.get("name") for e in trainer.get("env") or []} & _TORCH_RESERVED_ENVS)
    if reserved:
        out.append(Problem(obj, "spec.trainer.env", f"must not set the torch plugin's own {reserved}",
                           "trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch.go"))  # fmt: skip
    if runtime is None:
        return [*out, Problem(obj, "spec.runtimeRef", "names no TrainingRuntime of the bundle",
                              "trainer v2.3.0 pkg/runtime/core/trainingruntime.go")]  # fmt: skip
    source = "jobset v0.12.0 pkg/webhooks/jobset_webhook.go"
    for rjob in runtime["spec"]["template"]["spec"].get("replicatedJobs", []):
        last_job = int(rjob.get("replicas", 1)) - 1
        job_name = f"{name}-{rjob['name']}-{last_job}"
        why = _label(job_name, _DNS1035_LABEL, "DNS-1035 label")
        if why:
            out.append(Problem(obj, "metadata.name (its JobSet's Jobs)", why, source, "name"))
        completions = rjob["template"]["spec"].get("completions") or trainer.get("numNodes")
        if completions:
            pod_name = f"{job_name}-{int(completions) - 1}-abcde"
            why = _label(pod_name, _DNS1035_LABEL, "DNS-1035 label")
            if why:
                out.append(Problem(obj, "metadata.name (its JobSet's pods)", why, source, "name"))
    return out


def _hpa(hpa: dict) -> list[Problem]:
    """autoscaling/v2, kubernetes v1.33 pkg/apis/autoscaling/validation/validation.go
    (validateHorizontalPodAutoscalerSpec): minReplicas >= 1 (0 only behind the alpha
    HPAScaleToZero gate), maxReplicas >= 1 and >= minReplicas."""
    name, spec = hpa["metadata"]["name"], hpa["spec"]
    obj, source = f"HorizontalPodAutoscaler {name}", "kubernetes v1.33 pkg/apis/autoscaling/validation/validation.go"
    low, high = int(spec.get("minReplicas", 1)), int(spec["maxReplicas"])
    if low < 1:
        return [Problem(obj, "spec.minReplicas", f"must be at least 1, got {low}", source, "min_replicas")]
    if high < low:
        return [Problem(obj, "spec.maxReplicas", f"must be at least minReplicas ({low}), got {high}", source, "max_replicas")]
    return []


# keda apis/keda/v1alpha1/scaledobject_webhook.go, maxK8sLabelValueLength; getHpaName.
_KEDA_HPA_PREFIX = "keda-hpa-"


def _scaledobject(scaled: dict, hpas: list[dict]) -> list[Problem]:
    """KEDA's validating webhook, kedacore/keda v2.20.1-117 (8b4f083c)
    apis/keda/v1alpha1/scaledobject_webhook.go: the name, and the HPA KEDA makes from it
    (``keda-hpa-<name>``), are label values of 63 characters at most (verifyName);
    minReplicaCount <= maxReplicaCount (verifyReplicaCount, CheckReplicaCountBoundsAreValid
    in scaledobject_types.go); a workload another HPA already scales is refused (verifyHpas)."""
    name, spec = scaled["metadata"]["name"], scaled["spec"]
    obj, source = f"ScaledObject {name}", "keda v2.20.1 apis/keda/v1alpha1/scaledobject_webhook.go"
    out = []
    for what in (name, _KEDA_HPA_PREFIX + name):
        if len(what) > 63:
            out.append(Problem(obj, "metadata.name", f"{what!r} is {len(what)} characters, more than a label "
                                                     "value's 63", source, "name"))  # fmt: skip
    low, high = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
    if low > high:
        out.append(Problem(obj, "spec.minReplicaCount", f"{low} must be less than maxReplicaCount {high}", source,
                           "max_replicas"))  # fmt: skip
    target = spec["scaleTargetRef"]["name"]
    for hpa in hpas:
        if hpa["spec"]["scaleTargetRef"]["name"] == target:
            out.append(Problem(obj, "spec.scaleTargetRef", f"the workload {target!r} is already managed by the hpa "
                                                           f"{hpa['metadata']['name']!r}", source))  # fmt: skip
    return out
