"""Rendered Kubernetes manifests: valid against the real schemas, wired correctly.

Core kinds are checked with kubernetes-validate (strict: unknown fields fail) for the
oldest and newest Kubernetes we target; PyTorchJob, TrainingRuntime, TrainJob and the
collectors' PodMonitoring and PodMonitor with jsonschema against the openAPIV3Schema of
their CRDs in tests/schemas/, made strict the same way.
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import shlex
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy import admission
from torchrec_cloud.deploy.manifests import LAUNCHER_TEMPLATES, load_documents, render_bundle, render_storage
from torchrec_cloud.deploy.profiles import load_profile, profile_names
from torchrec_cloud.deploy.schedulable import pod_specs
from torchrec_cloud.deploy.spec import DeploySpec, TrainFlagsError

from pod_security import violations

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "tests" / "schemas"
K8S_VERSIONS = ["1.31", kubernetes_validate.utils.latest_version()]
CLOUDS = profile_names()
CRD_FILES = {
    ("kubeflow.org/v1", "PyTorchJob"): SCHEMAS / "kubeflow.org_pytorchjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): SCHEMAS / "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): SCHEMAS / "trainer.kubeflow.org_trainingruntimes.yaml",
    ("monitoring.googleapis.com/v1", "PodMonitoring"): SCHEMAS / "monitoring.googleapis.com_podmonitorings.yaml",
    ("azmonitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "azmonitoring.coreos.com_podmonitors.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda.sh_scaledobjects.yaml",
    ("serving.kserve.io/v1beta1", "InferenceService"): SCHEMAS / "serving.kserve.io_inferenceservices.yaml",
}
# What each cloud's collector needs beside the pod metadata (monitoring_profiles.yaml.j2);
# EKS's CloudWatch ConfigMaps configure the agent for the whole cluster: only on request.
COLLECTOR_KINDS = {"aws": [], "azure": ["PodMonitor"], "gcp": ["PodMonitoring"], "generic": []}
LAUNCHER_KINDS = {"job": ["Service", "Job", "NetworkPolicy"], "pytorchjob": ["PyTorchJob", "NetworkPolicy"],
                  "trainjob": ["TrainingRuntime", "TrainJob", "NetworkPolicy"]}


def collector_kinds(cloud: str, launcher: str, cluster_monitoring: bool = False) -> list[str]:
    if cloud == "aws" and cluster_monitoring:
        return ["ConfigMap", "ConfigMap"]
    return COLLECTOR_KINDS[cloud]


def _strict(schema):
    """Reject unknown fields, as the API server's strict field validation does."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


@lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str):
    crd = yaml.safe_load(CRD_FILES[(api_version, kind)].read_text())
    version = api_version.split("/")[1]
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(v["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@lru_cache(maxsize=None)
def core_validator(version: str, api_version: str, kind: str):
    """kubernetes-validate's strict schema for a kind, compiled once (its validate() reloads
    the definitions file on every call)."""
    from referencing import Registry, Resource

    from kubernetes_validate.utils import all_versions, major_minor, schema_contents

    (resolved,) = [v for v in all_versions() if major_minor(v) == major_minor(version)][-1:]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{resolved}-local-strict"
    schema = schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    definitions = schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(doc: dict) -> None:
    key = (doc["apiVersion"], doc["kind"])
    validators = [crd_validator(*key)] if key in CRD_FILES else [core_validator(v, *key) for v in K8S_VERSIONS]
    for validator in validators:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{doc['kind']} {list(e.path)}: {e.message}" for e in errors[:10])


def test_validators_reject_what_the_api_server_rejects():
    """The checks above can fail: an unknown field and a wrong type are caught."""
    job = by_kind(render(cloud="generic", launcher="job", nodes=2, gpus_per_node=1), "Job")
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(AssertionError, match="comand"):
        validate(bad)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    tj = by_kind(render(cloud="generic", launcher="trainjob", nodes=2, gpus_per_node=1), "TrainJob")
    tj["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(AssertionError, match="numNodes"):
        validate(tj)
    pm = by_kind(render(cloud="gcp", launcher="job", nodes=2, gpus_per_node=1), "PodMonitoring")
    del pm["spec"]["endpoints"][0]["interval"]
    pm["spec"]["endpoints"][0]["pth"] = "/metrics"
    with pytest.raises(AssertionError, match="interval(.|\n)*pth|pth(.|\n)*interval"):
        validate(pm)
    pmon = by_kind(render(cloud="azure", launcher="job", nodes=2, gpus_per_node=1), "PodMonitor")
    pmon["spec"]["podMetricsEndpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(AssertionError, match="interval"):
        validate(pmon)


def render(**kw) -> list[dict]:
    return load_documents(render_bundle(DeploySpec(**kw)))


def by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("launcher", list(LAUNCHER_TEMPLATES))
@pytest.mark.parametrize("spot", [False, True])
def test_every_cloud_and_launcher_renders_valid_objects(cloud, launcher, spot):
    ckpt = "s3://bucket/ckpt" if spot else None
    docs = render(cloud=cloud, launcher=launcher, nodes=3, gpus_per_node=8, spot=spot, checkpoint_url=ckpt,
                  train_args=["--batch_size", "4096"])
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Namespace", "ServiceAccount", *LAUNCHER_KINDS[launcher], *collector_kinds(cloud, launcher)]
    for doc in docs:
        validate(doc)
    assert admission.check(docs) == []  # what the API server and the operators' webhooks admit
    assert_hardened(docs)
    text = render_bundle(DeploySpec(cloud=cloud, launcher=launcher, nodes=3, gpus_per_node=8, spot=spot,
                                    checkpoint_url=ckpt))
    profile = load_profile(cloud)
    for key, value in profile.env.items():
        assert key in text and str(value) in text
    if spot:
        for key in profile.spot["node_selector"]:
            assert key in text


@pytest.mark.parametrize("cloud", CLOUDS)
def test_storage_manifests_are_valid(cloud):
    text = render_storage(DeploySpec(cloud=cloud))
    if load_profile(cloud).storage is None:
        assert text is None
        return
    docs = load_documents(text)
    assert [d["kind"] for d in docs] == ["PersistentVolume", "PersistentVolumeClaim"]
    for doc in docs:
        validate(doc)
    pv, pvc = docs
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pv["spec"]["claimRef"] == {"namespace": pvc["metadata"]["namespace"], "name": pvc["metadata"]["name"]}
    job = by_kind(render(cloud=cloud, launcher="job", nodes=2, gpus_per_node=8), "Job")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in job["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]


def _flags(args: list[str]) -> dict[str, str]:
    """``--flag=value`` words of a launch command before ``-m``."""
    head = args[: args.index("-m")]
    return dict(a.split("=", 1) for a in head if a.startswith("--") and "=" in a)


def test_indexed_job_wiring():
    from torchrec_cloud.launch import EXIT_CONFIG, EXIT_PREEMPTED

    docs = render(cloud="aws", launcher="job", nodes=4, gpus_per_node=8, name="dlrm-a", namespace="team",
                  train_args=["--batch_size", "4096"])
    svc, job = by_kind(docs, "Service"), by_kind(docs, "Job")
    pod = job["spec"]["template"]
    spec = pod["spec"]
    # The Service exists in the same bundle, is headless, and selects exactly these pods.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert spec["subdomain"] == svc["metadata"]["name"]
    assert svc["metadata"]["namespace"] == job["metadata"]["namespace"] == "team"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    (c,) = spec["containers"]
    assert c["command"] == ["torchrec-cloud", "launch"]
    flags = _flags(c["args"])
    # Pod 0's stable name: $(job-name)-0.$(subdomain); c10d, which re-forms the group after a restart.
    assert flags["--rdzv_endpoint"] == f"dlrm-a-0.{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    assert flags["--rdzv_backend"] == "c10d" and flags["--rdzv_id"] == "dlrm-a"
    assert flags["--rdzv_conf"] == "join_timeout=1800,read_timeout=1800"
    assert flags["--nnodes"] == "4" and flags["--nproc_per_node"] == "8"
    args = c["args"]
    assert args[args.index("-m") + 1 : args.index("-m") + 3] == ["torchrec_cloud", "train"]
    assert "--batch_size" in args and "4096" in args
    # Node index from the Job controller's annotation: the launcher makes pod 0 the store's host.
    env = {e["name"]: e for e in c["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    # Checkpoint on SIGTERM: torchrun gives workers less time than the kubelet gives the pod.
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= 300 and 0 < int(flags["--shutdown_timeout"]) < grace
    assert spec["restartPolicy"] == "Never"
    # Preemptions (the disruption condition, or the launcher's own exit code) are replaced
    # without counting; a refused flag fails the Job; crashes are counted per node.
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [EXIT_PREEMPTED]}},
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [EXIT_CONFIG]}},
    ]
    assert job["spec"]["backoffLimitPerIndex"] == 3 and job["spec"]["maxFailedIndexes"] == 0
    assert "backoffLimit" not in job["spec"]
    # /dev/shm is memory-backed and sized; one pod per node.
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # Memory capped at the request: a leak is an OOM kill (counted), not a node-pressure
    # eviction (DisruptionTarget: restarted uncounted).
    assert c["resources"]["limits"] == {"cpu": "88", "memory": "1000Gi", "nvidia.com/gpu": 8,
                                        "vpc.amazonaws.com/efa": 4}
    assert c["resources"]["requests"]["memory"] == "1000Gi"
    assert spec["securityContext"]["runAsNonRoot"] is True
    # What the pods are told about their grace (not spot: the pod's own), and what the Job needs.
    assert env["TORCHREC_CLOUD_GRACE_S"]["value"] == str(grace)
    assert job["metadata"]["annotations"] == {"torchrec-cloud/min-kubernetes": "1.33"}
    assert flags["--peer_timeout_s"] == "30"


def test_pytorchjob_launches_in_container_named_pytorch():
    pj = by_kind(render(cloud="gcp", launcher="pytorchjob", nodes=2, gpus_per_node=8), "PyTorchJob")
    worker = pj["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert set(pj["spec"]["pytorchReplicaSpecs"]) == {"Worker"}  # elastic: workers only
    assert worker["replicas"] == 2
    # Exit codes >= 128 (a preemption's, a kill's) recreate the pod without counting;
    # in-place restarts (OnFailure) would count every preemption against backoffLimit.
    assert worker["restartPolicy"] == "ExitCode"
    assert pj["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    # training-operator v1.9 ignores a backoffLimit >= 1 under ExitCode and fails the job at
    # the first preemption with 0: none is rendered.
    assert "backoffLimit" not in pj["spec"]["runPolicy"]
    (c,) = worker["template"]["spec"]["containers"]
    assert c["name"] == "pytorch" and c["command"] == ["torchrec-cloud", "launch"]
    assert c["args"][c["args"].index("-m") + 1 :][:2] == ["torchrec_cloud", "train"]
    assert not any(a.startswith(("--rdzv", "--nnodes", "--master")) for a in c["args"])  # operator's job
    env = {e["name"]: e for e in c["env"]}
    assert env["TORCHREC_CLOUD_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['training.kubeflow.org/replica-index']"
    )
    ep = pj["spec"]["elasticPolicy"]
    assert ep["rdzvBackend"] == "c10d" and ep["minReplicas"] == ep["maxReplicas"] == 2
    assert pj["spec"]["nprocPerNode"] == "8"
    assert {c["key"]: c["value"] for c in ep["rdzvConf"]} == {"join_timeout": "1800", "read_timeout": "1800"}


def _runtime_container_name() -> str:
    # Kubeflow's own runtime is Helm-templated: read it as text. Its one container is the trainer.
    text = (SCHEMAS / "torch-distributed-runtime.yaml").read_text()
    assert re.search(r"^\s+- name: node\n\s+template:", text, re.M), "replicated job 'node' not found"
    return re.search(r"containers:\n\s+- name: (\S+)", text).group(1)


def test_trainjob_runs_on_a_runtime_of_its_own_that_restarts_it_after_a_preemption():
    from torchrec_cloud.launch import EXIT_CONFIG, EXIT_PREEMPTED

    docs = render(cloud="azure", launcher="trainjob", nodes=3, gpus_per_node=8)
    tj, rt = by_kind(docs, "TrainJob"), by_kind(docs, "TrainingRuntime")
    assert tj["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                        "name": rt["metadata"]["name"]}  # fmt: skip
    assert rt["metadata"]["namespace"] == tj["metadata"]["namespace"]
    assert rt["spec"]["mlPolicy"] == {"numNodes": 3, "torch": {}}
    trainer = tj["spec"]["trainer"]
    assert trainer["numNodes"] == 3 and trainer["numProcPerNode"] == 8
    assert trainer["command"] == ["torchrec-cloud", "launch"]
    flags = _flags(trainer["args"])
    # Kubeflow Trainer sets node 0's address for a static rendezvous; c10d meets there instead.
    assert flags["--rdzv_backend"] == "c10d"
    assert flags["--rdzv_endpoint"] == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    assert trainer["args"][trainer["args"].index("-m") + 1 :][:2] == ["torchrec_cloud", "train"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    jobset = rt["spec"]["template"]["spec"]
    (rj,) = jobset["replicatedJobs"]
    assert rj["name"] == "node" and rj["replicas"] == 1
    assert rj["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    job = rj["template"]["spec"]
    pod = job["template"]
    assert [c["name"] for c in pod["spec"]["containers"]] == [_runtime_container_name()]
    assert pod["spec"]["restartPolicy"] == "Never"  # what a podFailurePolicy needs
    assert pod["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert pod["spec"]["serviceAccountName"] == "torchrec-trainer"
    # A preemption fails the Job through its podFailurePolicy, and the JobSet restarts it
    # without using up maxRestarts; a refused flag fails the JobSet; a crash is counted.
    assert job["backoffLimit"] == 0
    actions = [(r["action"], r.get("onExitCodes", {}).get("values"), [c["type"] for c in r.get("onPodConditions", [])])
               for r in job["podFailurePolicy"]["rules"]]  # fmt: skip
    assert actions == [("FailJob", None, ["DisruptionTarget"]), ("FailJob", [EXIT_PREEMPTED], []),
                       ("FailJob", [EXIT_CONFIG], [])]  # fmt: skip
    policy = jobset["failurePolicy"]
    preempted, refused = policy["rules"]
    assert preempted["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    # The Job controller's own messages for those two rules (pod_failure_policy.go).
    for message in ("Pod ns/p has condition DisruptionTarget matching FailJob rule at index 0",
                    f"Container node for pod ns/p failed with exit code {EXIT_PREEMPTED} matching FailJob rule at index 1"):
        assert any(re.search(p, message) for p in preempted["onJobFailureMessagePatterns"]), message
    assert not any(re.search(p, f"Container node for pod ns/p failed with exit code {EXIT_CONFIG} matching FailJob "
                                "rule at index 2") for p in preempted["onJobFailureMessagePatterns"])
    assert refused["action"] == "FailJobSet" and refused["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert policy["maxRestarts"] == 3
    # JobSet's webhook denies a rule name with a '-': the TrainJob would be accepted and never run.
    assert all(admission.JOBSET_RULE_NAME.match(rule["name"]) for rule in policy["rules"]), policy["rules"]


def test_admission_refuses_what_a_cluster_would_refuse():
    """The rules of the API server and the operators' webhooks (deploy/admission.py) catch
    what the schemas let through; render refuses such a bundle in one line naming the flag."""
    docs = render(cloud="gcp", launcher="trainjob", nodes=2, gpus_per_node=8)
    assert admission.check(docs) == []
    rt = by_kind(docs, "TrainingRuntime")
    rt["spec"]["template"]["spec"]["failurePolicy"]["rules"][1]["name"] = "refused-flags"  # the old bundle's
    (problem,) = admission.check(docs)
    assert "'refused-flags' does not match" in str(problem) and "jobset v0.12.0" in problem.source

    # A name within Kubernetes' 63 characters whose generated pods' names are not.
    name = "a" * 49  # + "-node-0-1-abcde" = 64
    with pytest.raises(ConfigError, match=r"--name: TrainJob a{49} .*JobSet's pods.*64 characters"):
        render(cloud="gcp", launcher="trainjob", nodes=2, gpus_per_node=8, name=name)
    for launcher, generated in (("job", "pod hostname"), ("pytorchjob", "pods' Services")):
        docs = render(cloud="gcp", launcher=launcher, nodes=2, gpus_per_node=8)
        for doc in docs:
            if doc["kind"] in ("Job", "PyTorchJob"):
                doc["metadata"]["name"] = "b" * 62  # "-1", "-worker-1": past 63
        problems = [str(p) for p in admission.check(docs)]
        assert any(generated in p and "more than the 63" in p for p in problems), problems
    # The torch plugin sets PET_* itself and refuses a TrainJob that does.
    docs = render(cloud="generic", launcher="trainjob", nodes=2, gpus_per_node=1)
    by_kind(docs, "TrainJob")["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"})
    assert any("PET_NNODES" in str(p) for p in admission.check(docs))


def test_a_spot_job_saves_on_a_clock_and_knows_its_reclaim_grace():
    for cloud, grace in (("gcp", 15), ("azure", 30), ("aws", 120)):
        assert load_profile(cloud).reclaim_grace_s() == grace
        job = by_kind(render(cloud=cloud, launcher="job", nodes=2, gpus_per_node=8, spot=True,
                             checkpoint_url="s3://b/c"), "Job")  # fmt: skip
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert {e["name"]: e.get("value") for e in c["env"]}["TORCHREC_CLOUD_GRACE_S"] == str(grace)
        args = c["args"]
        assert args[args.index("--checkpoint_every_s") + 1] == "600" and "--async_checkpoint" in args
    # The user's own cadence wins.
    job = by_kind(render(cloud="gcp", launcher="job", nodes=2, gpus_per_node=8, spot=True, checkpoint_url="s3://b/c",
                         train_args=["--checkpoint_every_s", "120", "--no-async_checkpoint"]), "Job")  # fmt: skip
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--checkpoint_every_s") == 1 and args[args.index("--checkpoint_every_s") + 1] == "120"
    assert "--async_checkpoint" not in args


def test_workload_identity_is_an_annotation_not_a_secret():
    for cloud in CLOUDS:
        docs = render(cloud=cloud, launcher="job", nodes=2, gpus_per_node=8, identity="ID-123")
        sa = by_kind(docs, "ServiceAccount")
        identity = load_profile(cloud).identity
        if identity:
            assert sa["metadata"]["annotations"] == {identity["annotation"]: "ID-123"}
        text = yaml.safe_dump_all(docs)
        assert "secretKeyRef" not in text and "kind: Secret" not in text


def _code_only(path: Path) -> str:
    """A file's code without docstrings and comments (usage examples may name clouds)."""
    text = path.read_text()
    if path.suffix != ".py":
        return re.sub(r"\{#.*?#\}|^\s*#.*$", "", text, flags=re.M | re.S)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                  and isinstance(s.value.value, str))] or [ast.Pass()]
    return ast.unparse(tree)  # comments are gone too


def test_a_new_cloud_is_only_data(tmp_path):
    """Profiles cannot leak into the core: a cloud the code has never heard of renders."""
    profile = tmp_path / "othercloud.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "othercloud", "title": "Other", "kubernetes": "OKS",
        "gpu_resource": "amd.com/gpu", "default_instance": "big-8",
        "instances": {"big-8": {"gpus": 8, "requests": {"cpu": "60"}, "extra_resources": {"example.com/nic": 2}}},
        "env": {"OTHER_NET": "fast"}, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "identity": {"annotation": "other.example.com/identity", "example": "me"},
    }))
    for launcher in LAUNCHER_TEMPLATES:
        docs = render(cloud=str(profile), launcher=launcher, nodes=2, gpus_per_node=8)
        for doc in docs:
            validate(doc)
        text = yaml.safe_dump_all(docs)
        for needle in ("amd.com/gpu", "example.com/nic", "OTHER_NET", "other.example.com/identity", "big-8"):
            assert needle in text, (launcher, needle)
    core = [ROOT / "src/torchrec_cloud/deploy" / n
            for n in ("manifests.py", "spec.py", "profiles.py", "render.py", "schedulable.py", "managed.py")]
    # Storage templates are per storage kind (picked by a profile's data), so they may name it.
    storage_templates = {(load_profile(c).storage or {}).get("template") for c in CLOUDS}
    core += sorted(p for p in (ROOT / "src/torchrec_cloud/deploy/templates").glob("*.j2")
                   if p.name not in storage_templates and not p.name.startswith("cluster_")
                   and not p.name.startswith("README"))
    for path in core:
        words = set(re.findall(r"[a-z0-9]+", _code_only(path).lower()))
        assert not words & {"aws", "azure", "gcp", "eks", "aks", "gke", "efa"}, path


def test_cpu_nodes_request_no_gpu():
    job = by_kind(render(cloud="generic", launcher="job", nodes=2, gpus_per_node=0, procs_per_node=2), "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert "--nproc_per_node=2" in c["args"]
    # cpu and memory per process (the profile's process_resources), /dev/shm inside the limit.
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                              "limits": {"cpu": "4", "memory": "24Gi"}}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity)).groups()
    return int(number) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit]


def assert_hardened(docs: list[dict]) -> None:
    """Every pod any object of the bundle creates, whatever its kind: the restricted Pod
    Security Standard (tests/pod_security.py), no API token, cpu and memory requested and
    capped, /dev/shm inside the memory limit."""
    specs = list(pod_specs(docs))
    assert specs, [d["kind"] for d in docs]
    for spec in specs:
        assert violations(spec) == []
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), (c["name"], c["resources"])
            shm = [_bytes(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"]
                   if v.get("emptyDir", {}).get("medium") == "Memory"]
            assert shm and sum(shm) < _bytes(c["resources"]["limits"]["memory"])
    for job in (d for d in docs if d["kind"] == "PyTorchJob"):
        # training-operator adds its init container (no security context, refused by the
        # restricted namespace) to the workers of a job with a Master replica only
        # (pkg/controller.v1/pytorch/initcontainer.go, setInitContainer).
        assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert sa["automountServiceAccountToken"] is False
    (ns,) = [d for d in docs if d["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("launcher", list(LAUNCHER_TEMPLATES))
def test_cpu_pods_are_hardened_too(cloud, launcher):
    """CPU-only jobs (no instance type, no plan): the same standard, and requests and limits."""
    docs = render(cloud=cloud, launcher=launcher, nodes=2, gpus_per_node=0, procs_per_node=2)
    for doc in docs:
        validate(doc)
    assert_hardened(docs)


def test_the_restricted_checker_finds_each_violation():
    """tests/pod_security.py can fail: each field a pod could carry against the standard."""
    job = by_kind(render(cloud="generic", launcher="job", nodes=2, gpus_per_node=0), "Job")
    good = job["spec"]["template"]["spec"]
    assert violations(good) == []
    cases = {
        "host_namespaces": lambda s: s.update(hostPID=True),
        "privileged": lambda s: s["containers"][0]["securityContext"].update(privileged=True),
        "volumes": lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "host_ports": lambda s: s["containers"][0]["ports"][0].update(hostPort=29600),
        "privilege_escalation": lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        "run_as_non_root": lambda s: s["securityContext"].pop("runAsNonRoot"),
        "run_as_user": lambda s: s["containers"][0].setdefault("securityContext", {}).update(runAsUser=0),
        "seccomp": lambda s: s["securityContext"].pop("seccompProfile"),
        "capabilities": lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["IPC_LOCK"]),
        "sysctls": lambda s: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "proc_mount": lambda s: s["containers"][0]["securityContext"].update(procMount="Unmasked"),
    }
    for rule, mutate in cases.items():
        bad = copy.deepcopy(good)
        mutate(bad)
        found = violations(bad)
        assert found and all(f.startswith(rule + ":") for f in found), (rule, found)
    bad = copy.deepcopy(good)
    bad["containers"][0]["securityContext"]["capabilities"] = {"add": ["NET_BIND_SERVICE"]}
    assert violations(bad) == ["capabilities: trainer: capabilities do not drop ALL"]


def test_rdma_pods_add_ipc_lock_and_the_namespace_only_warns():
    """InfiniBand needs IPC_LOCK, outside the restricted standard: only pods that ask for the
    RDMA device get it, and their Namespace then warns and audits instead of refusing them."""
    docs = render(cloud="azure", launcher="job", nodes=2, gpus_per_node=8, rdma=True)
    (spec,) = list(pod_specs(docs))
    assert violations(spec) == ["capabilities: trainer: adds ['IPC_LOCK']"]
    labels = by_kind(docs, "Namespace")["metadata"]["labels"]
    assert "pod-security.kubernetes.io/enforce" not in labels
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_network_policy_admits_the_job_and_its_collector_only(cloud):
    """One NetworkPolicy per job: the job's own pods on every port (c10d store, gloo/NCCL on
    ephemeral ports), the cloud's collector on exactly the ranks' metrics ports, no one else."""
    from torchrec_cloud.deploy.manifests import build_context

    docs = render(cloud=cloud, launcher="job", nodes=2, gpus_per_node=8, train_args=["--prometheus_port", "30000"])
    policy = by_kind(docs, "NetworkPolicy")
    validate(policy)
    job = by_kind(docs, "Job")
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert policy["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, *collector = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]}  # same namespace, any port
    scraped_from = build_context(DeploySpec(cloud=cloud, nodes=2, gpus_per_node=8))["monitoring"].scraped_from
    assert scraped_from, f"{cloud}: no collector to admit"
    (rule,) = collector
    assert rule["from"] == scraped_from
    metrics = sorted(p["containerPort"] for p in job["spec"]["template"]["spec"]["containers"][0]["ports"]
                     if p["name"].startswith("metrics-"))
    assert metrics == list(range(30000, 30008))
    assert rule["ports"] == [{"protocol": "TCP", "port": 30000, "endPort": 30007}]


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(nodes=0), "nodes"),
        (dict(name="Bad_Name"), "name"),
        (dict(cloud="aws", gpus_per_node=16), "gpus_per_node"),
        (dict(cloud="aws", instance_type="p9.huge"), "instance_type"),
        (dict(grace_period_s=5), "grace_period_s"),
        (dict(train_args=["--batch_size", "0"]), "batch_size"),
        (dict(train_args=["--embedding_dim", "32", "--dense_arch_layer_sizes", "512,64"]), "dense_arch_layer_sizes"),
        (dict(gpus_per_node=0, train_args=["--embedding_kernel", "fused_uvm"]), "embedding_kernel"),
        (dict(gpus_per_node=1, gpu_memory=0), "gpu_memory"),
    ],
)
def test_bad_options_name_the_flag(kw, flag):
    with pytest.raises(ConfigError) as e:
        render_bundle(DeploySpec(**kw))
    assert e.value.flag == flag, str(e.value)


def test_a_cluster_that_cannot_hold_the_model_is_refused_in_one_line(capsys):
    from torchrec_cloud.cli import main

    args = ["--cloud", "generic", "--nodes", "1", "--gpus_per_node", "1", "--gpu_memory", "4", "--preset", "criteo-1tb"]
    assert main(["render", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    # The reason `plan` gives: the cluster, the largest table, the smallest cluster that holds it.
    assert "the model does not fit on 1 node of 1 GPU of 4 GiB" in err and "t_cat_0" in err
    assert "the smallest cluster that holds it:" in err
    # --no-plan renders it anyway, as it did before planning existed.
    assert main(["render", *args, "--no-plan"]) == 0
    assert "--embedding_kernel" not in capsys.readouterr().out


def _planned(docs: list[dict]) -> tuple[str, list[str]]:
    job = by_kind(docs, "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return job["spec"]["template"]["metadata"]["annotations"]["torchrec-cloud/plan"], c["args"]


def test_the_job_carries_the_planned_kernel_choice():
    # The seeds' criteo-1tb on one 80 GB GPU: some tables cached, so the planner on the node chooses.
    note, args = _planned(render(cloud="aws", instance_type="p4de.24xlarge", nodes=1, gpus_per_node=1,
                                 preset="criteo-1tb"))  # fmt: skip
    assert args[args.index("--embedding_kernel") + 1] == "auto"
    assert "fused_uvm_caching on 1 rank" in note
    # Two nodes of 8 A100s hold every table in GPU memory: the job pins that.
    note, args = _planned(render(cloud="aws", nodes=2, gpus_per_node=8, preset="criteo-1tb"))
    assert args[args.index("--embedding_kernel") + 1] == "fused" and note.startswith("26 tables: 26 fused on 16 ranks")
    # The user's kernel wins, once.
    _, args = _planned(render(cloud="aws", nodes=2, gpus_per_node=8, preset="criteo-1tb",
                              train_args=["--embedding_kernel", "fused_uvm_caching"]))  # fmt: skip
    assert args.count("--embedding_kernel") == 1 and args[args.index("--embedding_kernel") + 1] == "fused_uvm_caching"


def test_unknown_training_flag_is_rejected():
    with pytest.raises(TrainFlagsError, match="--no_such_flag"):
        render_bundle(DeploySpec(train_args=["--no_such_flag", "1"]))


def _pod_and_trainer(docs: list[dict], launcher: str) -> tuple[dict, list[dict], list[str], int]:
    """(pod template, declared container ports, `torchrec-cloud train` flags, processes per
    pod) of a bundle, read from where each launcher keeps them."""
    if launcher == "job":
        pod = by_kind(docs, "Job")["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        nproc = int(_flags(c["args"])["--nproc_per_node"])
        return pod, c.get("ports", []), c["args"][c["args"].index("train") + 1 :], nproc
    if launcher == "pytorchjob":
        pj = by_kind(docs, "PyTorchJob")
        pod = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        (c,) = pod["spec"]["containers"]
        return pod, c.get("ports", []), c["args"][c["args"].index("train") + 1 :], int(pj["spec"]["nprocPerNode"])
    tj = by_kind(docs, "TrainJob")
    (rj,) = by_kind(docs, "TrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"]
    pod = rj["template"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = tj["spec"]["trainer"]["args"]
    return pod, c.get("ports", []), args[args.index("train") + 1 :], tj["spec"]["trainer"]["numProcPerNode"]


def _seconds(duration: str) -> int:
    value, unit = re.fullmatch(r"(\d+)(s|m)", duration).groups()
    return int(value) * (60 if unit == "m" else 1)


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("launcher", list(LAUNCHER_TEMPLATES))
@pytest.mark.parametrize("gpus", [1, 8])
def test_collectors_scrape_the_ports_the_ranks_listen_on(cloud, launcher, gpus):
    """Rank r of a pod serves on --prometheus_port + r (the trainer's rule): the declared
    container ports, the scrape annotations and the collector's objects must name exactly
    those ports, select these pods, and scrape before the endpoint goes away."""
    from torchrec_cloud.config import config_from_args
    from torchrec_cloud.deploy.spec import _trainer_parser

    docs = render(cloud=cloud, launcher=launcher, nodes=2, gpus_per_node=gpus, name="dlrm-a", namespace="ml",
                  cluster_monitoring=True)
    pod, ports, trainer_args, nproc = _pod_and_trainer(docs, launcher)
    assert nproc == gpus
    assert trainer_args.count("--prometheus_port") == 1 and trainer_args.count("--prometheus_linger") == 1
    out = config_from_args(_trainer_parser().parse_args(trainer_args)).output
    listening = [out.prometheus_port + r for r in range(nproc)]
    assert out.metrics_host == "0.0.0.0"  # reachable from the collector, not only inside the pod

    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(listening[0])
    by_name = {p["name"]: p["containerPort"] for p in ports}
    metrics_names = sorted(n for n in by_name if n.startswith("metrics-"))
    assert sorted(by_name[n] for n in metrics_names) == listening
    assert len(set(by_name.values())) == len(by_name)  # no clash with the rendezvous port

    def resolve(port) -> int:
        return port if isinstance(port, int) else by_name[port]

    collectors = [d for d in docs if d["kind"] in ("PodMonitoring", "PodMonitor", "ConfigMap")]
    assert [d["kind"] for d in collectors] == collector_kinds(cloud, launcher, cluster_monitoring=True)
    for doc in collectors:
        if doc["kind"] in ("PodMonitoring", "PodMonitor"):
            assert doc["metadata"]["namespace"] == "ml"
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
            endpoints = doc["spec"].get("endpoints") or doc["spec"]["podMetricsEndpoints"]
            assert all(e["path"] == "/metrics" and _seconds(e["interval"]) < out.prometheus_linger for e in endpoints)
            assert sorted(resolve(e["port"]) for e in endpoints) == listening
        elif doc["metadata"]["name"] == "prometheus-config":
            config = yaml.safe_load(doc["data"]["prometheus.yaml"])
            assert _seconds(config["global"]["scrape_interval"]) < out.prometheus_linger
            (job,) = config["scrape_configs"]
            assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["ml"]
            pod_meta = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v for k, v in labels.items()}
            for rule in (r for r in job["relabel_configs"] if r.get("action") == "keep"):
                (source,) = rule["source_labels"]
                if source == "__meta_kubernetes_pod_container_port_name":
                    kept = [by_name[n] for n in by_name if re.fullmatch(rule["regex"], n)]
                    assert sorted(kept) == listening
                else:
                    assert re.fullmatch(rule["regex"], pod_meta[source]), rule


def test_a_prometheus_port_among_the_training_flags_moves_every_scrape_target():
    docs = render(cloud="gcp", launcher="job", nodes=2, gpus_per_node=2, train_args=["--prometheus_port", "31000"])
    pod, ports, trainer_args, _ = _pod_and_trainer(docs, "job")
    assert trainer_args.count("--prometheus_port") == 1
    assert trainer_args[trainer_args.index("--prometheus_port") + 1] == "31000"
    assert [p["containerPort"] for p in ports if p["name"].startswith("metrics-")] == [31000, 31001]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "31000"


def test_monitoring_data_has_one_home():
    """The per-cloud scrape data lives in monitoring_profiles.yaml.j2 only: the deployment
    profiles name an entry of it, and no deploy file spells a collector's API."""
    from torchrec_cloud.deploy.monitoring import monitoring_clouds

    for cloud in CLOUDS:
        assert load_profile(cloud).monitoring["profile"] in monitoring_clouds()
    deploy = ROOT / "src/torchrec_cloud/deploy"
    templates = [p for p in deploy.glob("templates/*.j2") if not p.name.startswith("README")]  # docs may cite them
    for path in [*deploy.glob("*.py"), *deploy.glob("profiles/*.yaml"), *templates]:
        text = path.read_text()
        for needle in ("monitoring.googleapis.com", "azmonitoring.coreos.com", "prometheus-cwagentconfig", "metrics-{"):
            assert needle not in text, (path, needle)


def test_more_local_ranks_than_one_podmonitoring_takes():
    """PodMonitoring allows 10 endpoints: 12 CPU processes per pod need two objects."""
    docs = render(cloud="gcp", launcher="job", nodes=2, gpus_per_node=0, procs_per_node=12)
    monitors = [d for d in docs if d["kind"] == "PodMonitoring"]
    assert len(monitors) == 2 and len({m["metadata"]["name"] for m in monitors}) == 2
    for m in monitors:
        validate(m)
    _, ports, _, _ = _pod_and_trainer(docs, "job")
    by_name = {p["name"]: p["containerPort"] for p in ports}
    scraped = sorted(by_name[e["port"]] for m in monitors for e in m["spec"]["endpoints"])
    port = load_profile("gcp").metrics_port
    assert scraped == list(range(port, port + 12))


def test_a_profile_naming_an_unknown_collector_says_so(tmp_path):
    profile = tmp_path / "mine.yaml"
    profile.write_text(yaml.safe_dump({"name": "mine", "title": "Mine", "kubernetes": "K",
                                       "monitoring": {"profile": "nosuchcollector"}}))
    from torchrec_cloud.deploy.profiles import ProfileError

    with pytest.raises(ProfileError, match="nosuchcollector.*aws, azure, gcp, generic"):
        render_bundle(DeploySpec(cloud=str(profile), gpus_per_node=0))


def test_a3_pods_get_no_gpudirect_tcpx_variable_without_the_host_network(capsys):
    """GPUDirect-TCPX needs pods on the host network beside GKE's privileged tcpx daemon; no
    bundle renders that (the restricted profile forbids it), so NCCL uses sockets on A3 and
    no TCPX variable may say otherwise (issue #43)."""
    from torchrec_cloud.cli import main

    for launcher in sorted(LAUNCHER_TEMPLATES):
        assert main(["render", "--cloud", "gcp", "--instance_type", "a3-highgpu-8g", "--launcher", launcher,
                     "--nodes", "2"]) == 0  # fmt: skip
        text = capsys.readouterr().out
        host_network = [s for d in load_documents(text) for s in pod_specs(d) if s.get("hostNetwork") is True]
        tcpx = sorted(set(re.findall(r"NCCL_GPUDIRECTTCPX_\w+", text)))
        assert host_network or not tcpx, f"{launcher}: {tcpx} without hostNetwork: true"
        assert "NCCL_SOCKET_IFNAME" in text, launcher  # the transport NCCL does use there


def test_a_profile_that_sets_tcpx_variables_is_refused_naming_what_they_need(tmp_path):
    from torchrec_cloud.deploy.profiles import ProfileError

    profile = tmp_path / "mine.yaml"
    profile.write_text(yaml.safe_dump({"name": "mine", "title": "Mine", "kubernetes": "K", "instances": {
        "a3": {"gpus": 8, "env": {"NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": "/run/tcpx"}}}}))  # fmt: skip
    with pytest.raises(ProfileError, match=r"instance 'a3' env sets NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX.*hostNetwork"):
        load_profile(str(profile))


# -- render --job preprocess: data preprocess over an Indexed Job's pods ---------------------

PREPROCESS = ["--schema", "/data/schema.yaml", "--input", "s3://bucket/events: 2024/", "gs://b/day #2.csv",
              "--output", "s3://bucket/out 'x'", "--split_by", "ts", "--val_from", "2024-03-01",
              "--test_from", "2024-03-15"]  # fmt: skip


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_preprocessing_job_is_an_indexed_job_of_cpu_pods_like_training(cloud):
    """Valid objects the cluster admits; one pod per share, each running `data preprocess` with
    the user's flags as given (quoting intact) and its share from JOB_COMPLETION_INDEX, no GPU,
    the profile's CPU requests; and the training job's pod spec (security, service account and
    identity, pools), storage and image: one place builds both."""
    from torchrec_cloud.data.cli import add_parser
    from torchrec_cloud.launch import EXIT_CONFIG

    docs = render(cloud=cloud, job="preprocess", nodes=3, image="registry.example/img:1", spot=True,
                  train_args=PREPROCESS)  # fmt: skip
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "Job", "NetworkPolicy"]
    for doc in docs:
        validate(doc)
    assert admission.check(docs) == []
    assert_hardened(docs)
    # Nothing connects to a share's pod: no ingress at all.
    assert by_kind(docs, "NetworkPolicy")["spec"]["ingress"] == []
    job = by_kind(docs, "Job")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    profile = load_profile(cloud)
    assert spec["backoffLimitPerIndex"] == profile.backoff_limit and spec["maxFailedIndexes"] == 0
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [EXIT_CONFIG]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/img:1"
    assert c["command"] == ["torchrec-cloud", "data", "preprocess"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    ns = parser.parse_args(["data", "preprocess", *c["args"]])
    assert (ns.schema, ns.input, ns.output) == ("/data/schema.yaml", ["s3://bucket/events: 2024/", "gs://b/day #2.csv"],
                                                "s3://bucket/out 'x'")  # fmt: skip
    assert (ns.split_by, ns.val_from, ns.test_from, ns.shares, ns.share_index) == ("ts", "2024-03-01", "2024-03-15", 3, None)
    assert ns.workers == int(profile.preprocess["requests"]["cpu"])
    assert {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}} in c["env"]  # fmt: skip
    # The profile's requests and limits; /dev/shm (its own, smaller size) inside the memory limit.
    shm = profile.preprocess["shm_size"]
    assert c["resources"]["requests"] == profile.preprocess["requests"]
    limits = profile.preprocess["limits"]
    assert c["resources"]["limits"] == {"cpu": limits["cpu"], "memory": f"{_bytes(limits['memory']) + _bytes(shm) >> 30}Gi"}
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["sizeLimit"] == shm
    assert not any("gpu" in r for part in c["resources"].values() for r in part)
    train = by_kind(render(cloud=cloud, launcher="job", nodes=3, gpus_per_node=8, image="registry.example/img:1",
                           spot=True, checkpoint_url="s3://b/ck", rdma=False), "Job")  # fmt: skip
    tpod = train["spec"]["template"]["spec"]
    (tc,) = tpod["containers"]
    same = ("serviceAccountName", "securityContext", "tolerations", "terminationGracePeriodSeconds")
    assert {k: pod.get(k) for k in same} == {k: tpod.get(k) for k in same}
    assert [v for v in pod["volumes"] if v["name"] != "dshm"] == [v for v in tpod["volumes"] if v["name"] != "dshm"]
    # The spot pools of training, not its GPU machine type.
    assert pod.get("nodeSelector", {}) == {k: v for k, v in tpod.get("nodeSelector", {}).items() if k != profile.instance_label}
    assert "affinity" not in pod  # shares may share a node
    assert (c["securityContext"], c["volumeMounts"]) == (tc["securityContext"], tc["volumeMounts"])
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in {**(profile.identity or {}).get("pod_labels", {}), **profile.pod_labels}.items())
    assert by_kind(docs, "ServiceAccount") == by_kind(render(cloud=cloud, launcher="job", nodes=3), "ServiceAccount")


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(launcher="pytorchjob"), "launcher"),
        (dict(nodes=3, train_args=[*PREPROCESS, "--shares", "2"]), "nodes"),
        (dict(train_args=[*PREPROCESS, "--share_index", "0"]), "--"),
        (dict(train_args=PREPROCESS[2:]), "--"),  # no --schema
        (dict(train_args=[*PREPROCESS, "--format", "kaggle"]), "--"),  # --schema and Criteo's --format
        (dict(train_args=[*PREPROCESS, "--no_such_flag"]), "--"),
        (dict(checkpoint_url="s3://b/ck"), "checkpoint_url"),
        (dict(job="index"), "job"),
    ],
)
def test_bad_preprocessing_job_options_name_the_flag(kw, flag):
    kw = {"job": "preprocess", "train_args": PREPROCESS, **kw}
    with pytest.raises(ConfigError) as e:
        render_bundle(DeploySpec(**kw))
    assert e.value.flag == flag, str(e.value)


def test_criteo_tsv_is_preprocessed_by_an_indexed_job_too():
    """Criteo's TSV (--format) is shared over pods as a schema's inputs are: each pod runs
    `data preprocess --format ...` with its share from JOB_COMPLETION_INDEX."""
    from torchrec_cloud.data.cli import add_parser

    criteo = ["--format", "kaggle", "--input", "s3://raw/train.txt", "--output", "s3://b/kaggle", "--num_embeddings", "1000"]
    docs = render(cloud="aws", job="preprocess", nodes=4, train_args=criteo)
    for doc in docs:
        validate(doc)
    assert admission.check(docs) == []
    job = by_kind(docs, "Job")
    assert job["spec"]["completions"] == 4
    (c,) = job["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    ns = parser.parse_args(["data", "preprocess", *c["args"]])
    assert (ns.format, ns.schema, ns.input, ns.output, ns.shares) == ("kaggle", None, ["s3://raw/train.txt"], "s3://b/kaggle", 4)


def test_render_job_preprocess_from_the_command_line(tmp_path, capsys):
    """`--shares N` among the flags sets the pods' number; the file is preprocess.yaml; the
    default job stays training; a bad flag is one line, exit 2."""
    from torchrec_cloud.cli import main

    assert main(["render", "--job", "preprocess", "--output", str(tmp_path), "--", *PREPROCESS, "--shares", "4"]) == 0
    job = by_kind(load_documents((tmp_path / "preprocess.yaml").read_text()), "Job")
    assert job["spec"]["completions"] == 4 and job["metadata"]["name"] == "torchrec-preprocess"
    assert main(["render", "--output", str(tmp_path / "t"), "--gpus_per_node", "0"]) == 0
    assert (tmp_path / "t" / "job.yaml").exists()
    capsys.readouterr()
    assert main(["render", "--job", "preprocess", "--", *PREPROCESS, "--split_by"]) == 2
    err = capsys.readouterr().err
    assert err == "torchrec-cloud render: error: data preprocess flags after '--': argument --split_by: expected one argument\n"
