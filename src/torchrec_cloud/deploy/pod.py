"""What every job's pods share, whatever they run (training, preprocessing, serving): names
and labels, the service account, where the pods may run and as whom, the container's
security context and resources, the volumes, and the NetworkPolicy.

``manifests.py`` (the training and preprocessing bundles) and ``serving.py`` (the serving
bundle) both build on it; it imports neither, so the deploy modules' imports point one way:
layout -> manifests -> serving -> pod.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import yaml

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.profiles import Profile, ProfileError
from torchrec_cloud.deploy.spec import MEMORY_UNITS, DeploySpec, memory_bytes

SERVICE_ACCOUNT = "torchrec-trainer"
JOB_LABEL = "torchrec-cloud/job"
# Where the trainer writes metrics.jsonl when no shared file system is mounted.
LOCAL_OUTPUT_ROOT = "/workspace/runs"


def images() -> dict[str, Any]:
    """images.yaml: the images' flavours, their pinned bases and the user they run as."""
    return yaml.safe_load((Path(__file__).parent / "images.yaml").read_text())


def workload_context(spec: DeploySpec, profile: Profile, instance, grace: int, one_per_node: bool = True) -> dict[str, Any]:
    """What every job's pods share, whatever they run (training, preprocessing): names and
    labels, the service account and its cloud identity, where the pods may run and as whom
    (``pod_spec``), the container's security context, and the volumes."""
    from torchrec_cloud.deploy.admission import MIN_KUBERNETES_ANNOTATION, MIN_OPERATORS_ANNOTATION, MIN_VERSIONS

    common_labels = {"app.kubernetes.io/name": "torchrec-cloud", "app.kubernetes.io/part-of": "torchrec-cloud"}
    selector = {JOB_LABEL: spec.name}
    identity = profile.identity or {}
    volumes, volume_mounts, storage, output_root = _volumes(spec, profile)
    if identity:
        sa_annotations = {identity["annotation"]: spec.identity or identity["example"]}
        identity_note = f"{identity['annotation']} grants cloud access without keys in the manifest."
    else:
        sa_annotations = {}
        identity_note = "No cloud identity: add your cluster's workload-identity annotation here."
    versions = MIN_VERSIONS[spec.launcher]
    workload_annotations = {MIN_KUBERNETES_ANNOTATION: versions["kubernetes"]}
    if versions["operators"]:
        workload_annotations[MIN_OPERATORS_ANNOTATION] = versions["operators"]
    rdma = _rdma(spec, profile, instance)
    return {
        "spec": spec,
        "profile": profile,
        "instance": instance,
        "name": spec.name,
        "namespace": spec.namespace,
        "image": spec.image,
        "nodes": spec.nodes,
        "common_labels": common_labels,
        "labels": {**common_labels, "app.kubernetes.io/instance": spec.name, **selector},
        "workload_annotations": workload_annotations,
        "selector": selector,
        "service_account": SERVICE_ACCOUNT,
        "service_account_annotations": sa_annotations,
        "identity_note": identity_note,
        "pod_spec": _pod_spec(spec, profile, instance, selector, grace, one_per_node),
        "rdma": rdma,
        "container_security": _container_security(profile, rdma),
        "pod_security_labels": _pod_security_labels(profile, rdma),
        "namespace_labels": {**common_labels, **_pod_security_labels(profile, rdma)},
        "volumes": volumes,
        "volume_mounts": volume_mounts,
        "storage": storage,
        "output_root": output_root,
    }


def _pod_spec(spec: DeploySpec, profile: Profile, instance, selector: dict, grace: int,
              one_per_node: bool = True) -> dict[str, Any]:  # fmt: skip
    """Where the pods may run and as whom: the profile's (spot) pools, one pod per node
    (``one_per_node``: a trainer pod takes the whole machine)."""
    node_selector = dict(profile.node_selector)
    tolerations = list(profile.tolerations)
    if instance is not None:
        node_selector[profile.instance_label] = instance.name
    if spec.spot:
        node_selector.update(profile.spot.get("node_selector", {}))
        tolerations += profile.spot.get("tolerations", [])
    uid = int(images()["user_id"])  # the image's own user (Dockerfile.j2's USER)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        # Nothing in the pod calls the Kubernetes API (the launchers meet in their own c10d
        # store). The clouds' workload identity needs no API token either: EKS's IRSA webhook
        # (amazon-eks-pod-identity-webhook) and Azure's (azure-workload-identity
        # pkg/webhook/webhook.go addProjectedVolume) each add a projected token volume of
        # their own audience, which the restricted standard admits; GKE's comes from the
        # node's metadata server.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace,
        # The restricted Pod Security Standard (docs/security.md), for the pod's every container.
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if not one_per_node:
        return pod_spec
    pod_spec["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": selector}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }
    return pod_spec


def _volumes(spec: DeploySpec, profile: Profile) -> tuple[list, list, Optional[dict], str]:
    """/dev/shm and the shared file system: (volumes, mounts, storage, where runs are written)."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size or profile.shm_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    storage = dict(profile.storage) if spec.storage and profile.storage else None
    output_root = LOCAL_OUTPUT_ROOT
    if storage:
        if spec.storage_claim:
            storage["claim_name"] = spec.storage_claim
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": storage["claim_name"]}})
        mounts.append({"name": "data", "mountPath": storage["mount_path"]})
        output_root = f"{storage['mount_path']}/runs"
    return volumes, mounts, storage, output_root


def _rdma(spec: DeploySpec, profile: Profile, instance) -> bool:
    """Whether the pods ask for the instance's RDMA device resource (``--rdma``)."""
    if instance is None or not spec.gpus_per_node or not instance.rdma_resources:
        return False
    return profile.request_rdma if spec.rdma is None else bool(spec.rdma)


_CPU = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m?)$")
def _millicores(value: Any, where: str) -> int:
    m = _CPU.match(str(value))
    if not m:
        raise ProfileError(f"{where}: cpu must be a Kubernetes quantity like 4 or 500m, got {value!r}")
    return round(float(m.group(1)) * (1 if m.group(2) else 1000))


def _bytes(value: Any, flag: str, where: str) -> int:
    n = memory_bytes(value)
    if n is None:
        raise ConfigError(flag, f"{where}: must be a Kubernetes quantity like 16Gi, got {value!r}")
    return n


def _cpu_text(millis: int) -> str:
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def _memory_text(n: int) -> str:
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        if n % MEMORY_UNITS[unit] == 0:
            return f"{n // MEMORY_UNITS[unit]}{unit}"
    return str(n)


def _resources(spec: DeploySpec, profile: Profile, instance, rdma: bool) -> dict[str, Any]:
    """cpu and memory requested and capped on every pod, the devices it drives.

    A pod on GPUs of a profile's instance takes the instance's requests and limits, in
    proportion to the GPUs it asks for (all of them: most of the node, so nothing else lands
    beside the trainer). Any other pod (CPU nodes, a cluster without instance types) takes
    the profile's ``process_resources`` per trainer process, with /dev/shm's size added to
    its memory limit. Limits default to the requests, and the memory limit holds /dev/shm: a
    memory-backed emptyDir's files count against the container's memory limit (Kubernetes
    docs, "Volumes: emptyDir"; the API's EmptyDirVolumeSource.sizeLimit: a memory medium's use
    is the lesser of sizeLimit and the pod's memory limits). A leak is then an OOM kill of the
    container (counted), never a node-pressure eviction that restarts the job uncounted.
    """
    shm = _bytes(spec.shm_size or profile.shm_size, "shm_size", "/dev/shm size")
    where = f"profile {profile.name!r}"
    if instance is not None and spec.gpus_per_node and {"cpu", "memory"} <= set(instance.requests):
        share = spec.gpus_per_node / instance.gpus if instance.gpus else 1.0
        where += f", {instance.name}"
        requests = {"cpu": _millicores(instance.requests["cpu"], where) * share,
                    "memory": _bytes(instance.requests["memory"], "instance_type", where) * share}
        limits = dict(requests)
        if "cpu" in instance.limits:
            limits["cpu"] = _millicores(instance.limits["cpu"], where) * share
        if "memory" in instance.limits:
            limits["memory"] = _bytes(instance.limits["memory"], "instance_type", where) * share
    else:
        per = profile.process_resources
        requests = {"cpu": _millicores(per["cpu"], where) * spec.procs,
                    "memory": _bytes(per["memory"], "cloud", where) * spec.procs}
        limits = {**requests, "memory": requests["memory"] + shm}
    if shm >= limits["memory"]:
        limit = _memory_text(int(limits["memory"]))
        raise ConfigError("shm_size", f"{_memory_text(shm)} of /dev/shm leaves nothing of the pod's {limit} "
                                      "memory limit (it counts against it)")  # fmt: skip
    resources: dict[str, Any] = {
        "requests": {"cpu": _cpu_text(int(requests["cpu"])), "memory": _memory_text(int(requests["memory"]))},
        "limits": {"cpu": _cpu_text(int(limits["cpu"])), "memory": _memory_text(int(limits["memory"]))},
    }
    if spec.gpus_per_node:
        resources["limits"][profile.gpu_resource] = spec.gpus_per_node
        if instance is not None:
            resources["limits"].update(instance.extra_resources)
            if rdma:
                resources["limits"].update(instance.rdma_resources)
    return resources


def _container_security(profile: Profile, rdma: bool) -> dict[str, Any]:
    """The restricted Pod Security Standard's container rules: no privilege escalation, every
    capability dropped; a profile adds back only what its devices need (RDMA: IPC_LOCK,
    which takes the pod out of the restricted profile: docs/security.md)."""
    add = [*profile.container_capabilities, *(profile.rdma_capabilities if rdma else [])]
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = add
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


# What the restricted Pod Security Standard lets a container add back (pod-security-admission
# policy/check_capabilities_restricted.go).
RESTRICTED_CAPABILITIES = {"NET_BIND_SERVICE"}


def _pod_security_labels(profile: Profile, rdma: bool) -> dict[str, str]:
    """The Namespace's Pod Security Admission labels: the API server enforces the restricted
    standard on every pod of the job's namespace, unless a capability the profile adds is
    outside it (then it warns and audits only)."""
    restricted = set(profile.container_capabilities) | (set(profile.rdma_capabilities) if rdma else set())
    labels = {"pod-security.kubernetes.io/warn": "restricted", "pod-security.kubernetes.io/audit": "restricted"}
    if restricted <= RESTRICTED_CAPABILITIES:
        labels["pod-security.kubernetes.io/enforce"] = "restricted"
    return labels


def _network_policy(spec: DeploySpec, profile: Profile, monitoring, metrics_port: int, selector: dict,
                    labels: dict, peers: bool = True) -> dict[str, Any]:  # fmt: skip
    """Ingress to the job's pods: from its own pods on any port (the c10d store on the
    rendezvous port, and gloo/NCCL, whose data connections use ephemeral ports), and from the
    cloud's metrics collector (monitoring_profiles.yaml.j2 ``scraped_from``) on the ranks'
    metrics ports; nothing else. Egress is left open (buckets, registries, DNS)."""
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": dict(selector)}}]}] if peers else []
    if monitoring is not None and monitoring.scraped_from:
        port: dict[str, Any] = {"protocol": "TCP", "port": metrics_port}
        if spec.procs > 1:
            port["endPort"] = metrics_port + spec.procs - 1
        ingress.append({"from": list(monitoring.scraped_from), "ports": [port]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": dict(labels)},
        "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }
