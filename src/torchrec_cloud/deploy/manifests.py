"""Kubernetes manifests from one set of Jinja2 templates and a cloud profile.

:func:`build_context` turns a :class:`DeploySpec` and a :class:`Profile` into plain values
(labels, node selector, env, volumes, the `torchrec-cloud launch` command); the templates in
``templates/`` only lay them out. Each launcher is a list of templates::

    job         Namespace, ServiceAccount, headless Service, Indexed Job
    --job preprocess: Namespace, ServiceAccount, Indexed Job of `data preprocess` pods
    pytorchjob  Namespace, ServiceAccount, Kubeflow v1 PyTorchJob
    trainjob    Namespace, ServiceAccount, Kubeflow Trainer v2 TrainingRuntime + TrainJob

Every bundle passes :mod:`torchrec_cloud.deploy.admission` (the API server's and the
operators' webhooks' rules) before it is returned, and records the versions it needs.
Followed by the objects the cluster's metrics collector needs (the profile's ``monitoring``
key picks them from :func:`torchrec_cloud.deploy.monitoring.monitoring_profile`, which also
gives the pod labels, annotations, metrics container ports and trainer flags)::

    text = render_bundle(DeploySpec(cloud="generic", nodes=2, gpus_per_node=8))
    docs = list(yaml.safe_load_all(text))
"""

from __future__ import annotations

import json
import shlex
from functools import lru_cache
from typing import Any, Optional

import jinja2
import yaml

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.profiles import Profile, ProfileError, load_profile
from torchrec_cloud.deploy.spec import DeploySpec

LAUNCHER_TEMPLATES = {
    "job": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "service.yaml.j2", "job.yaml.j2"],
    "pytorchjob": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "pytorchjob.yaml.j2"],
    # A TrainJob cannot set its JobSet's failure policy or its Job's podFailurePolicy (its
    # runtimePatches take pod metadata and a few container fields): the bundle carries a
    # TrainingRuntime of its own, which can.
    "trainjob": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "trainingruntime.yaml.j2", "trainjob.yaml.j2"],
}
# `--job preprocess`: an Indexed Job of `data preprocess` pods (no Service: they never talk).
PREPROCESS_TEMPLATES = ["namespace.yaml.j2", "serviceaccount.yaml.j2", "preprocess_job.yaml.j2"]
SERVICE_ACCOUNT = "torchrec-trainer"
JOB_LABEL = "torchrec-cloud/job"
# The pods' annotation with the plan made before rendering (`kubectl describe pod`).
PLAN_ANNOTATION = "torchrec-cloud/plan"
# Where the trainer writes metrics.jsonl when no shared file system is mounted.
LOCAL_OUTPUT_ROOT = "/workspace/runs"
# The seconds between SIGTERM and SIGKILL a pod can count on (the trainer's
# --sigterm_grace_s): a spot job's reclaim grace, else its terminationGracePeriodSeconds.
GRACE_ENV = "TORCHREC_CLOUD_GRACE_S"


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (config files inside ConfigMaps) as readable ``|`` blocks."""


def _str_block(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_block)


def _dump(value: Any) -> str:
    return yaml.dump(value, Dumper=_BlockDumper, default_flow_style=False, sort_keys=False, width=1000).rstrip("\n")


def _nindent(value: Any, indent: int) -> str:
    """A value after ``key:``: inline ``{}``/``[]`` when empty, else an indented block."""
    if not value:
        return " []" if isinstance(value, list) else " {}"
    pad = " " * indent
    return "\n" + "\n".join(pad + line for line in _dump(value).splitlines())


def _yaml_block(value: Any, indent: int) -> str:
    """A mapping's keys laid out at ``indent`` (for splicing keys into a parent mapping)."""
    if not value:
        return ""
    pad = " " * indent
    return "\n".join(pad + line for line in _dump(value).splitlines())


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("torchrec_cloud.deploy", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        autoescape=False,
    )
    env.filters["nindent"] = _nindent
    env.filters["yaml_block"] = _yaml_block
    env.filters["toyaml"] = _dump
    env.filters["shquote"] = shlex.quote
    env.filters["json"] = lambda value: json.dumps(value, separators=(",", ":"))
    env.filters["taint"] = lambda t: f"{t['key']}={t.get('value', '')}:{t['effect']}"
    return env


def render_template(template: str, /, **context: Any) -> str:
    return environment().get_template(template).render(**context)


# Every launcher starts the trainer through `torchrec-cloud launch` (torchrun with exit codes
# the controllers act on: 0 only for a finished run, EXIT_PREEMPTED for a preemption).
LAUNCH_COMMAND = ["torchrec-cloud", "launch"]
PREPROCESS_COMMAND = ["torchrec-cloud", "data", "preprocess"]


def spot_train_args(spec: DeploySpec, profile: Profile) -> list[str]:
    """A spot job's trainer flags, on every target (Kubernetes, Azure ML, Vertex AI, TorchX):
    it saves on a clock (``spot.checkpoint_every_s``), in the background, since a reclaim's
    grace is too short for a large model's save; the user's own flags win (``trainer_args``)."""
    if not spec.spot:
        return []
    return ["--checkpoint_every_s", str(profile.spot["checkpoint_every_s"]), "--async_checkpoint"]


def build_context(spec: DeploySpec, profile: Optional[Profile] = None) -> dict[str, Any]:
    """Every value the templates use, computed from the spec and the profile's data."""
    from torchrec_cloud.launch import EXIT_CONFIG, EXIT_PREEMPTED

    profile = profile or load_profile(spec.cloud)
    if spec.job == "preprocess":
        return preprocess_context(spec, profile)
    instance = _instance(spec, profile)
    grace = spec.grace_period_s or profile.termination_grace_period_s
    workload = _workload_context(spec, profile, instance, grace)
    metrics_port = spec.user_prometheus_port() or profile.metrics_port
    monitoring = _monitoring(spec, profile, metrics_port)
    output_root = workload["output_root"]
    spot_args = spot_train_args(spec, profile)
    trainer_args = spec.trainer_args(output_root, [*monitoring.container_args, *spot_args])
    plan, planned_args = _plan(spec, profile, instance, trainer_args)
    if planned_args:
        trainer_args = spec.trainer_args(output_root, [*monitoring.container_args, *spot_args, *planned_args])
    launch = _launch_args(spec, profile, grace, trainer_args)
    env = {**profile.env, **(instance.env if instance is not None else {})}
    env_grace = min(grace, spec.reclaim_grace_s or profile.reclaim_grace_s()) if spec.spot else grace
    env[GRACE_ENV] = env_grace
    identity = profile.identity or {}
    labels = workload["labels"]

    ctx: dict[str, Any] = {
        **workload,
        "procs": spec.procs,
        "world_size": spec.world_size,
        "pod_labels": {**labels, **identity.get("pod_labels", {}), **monitoring.pod_labels, **profile.pod_labels},
        "pod_annotations": {**monitoring.pod_annotations, **profile.pod_annotations,
                            **({PLAN_ANNOTATION: plan["summary"]} if plan else {})},
        "env": [{"name": k, "value": str(v)} for k, v in env.items()],
        "resources": _resources(spec, profile, instance),
        "backoff_limit": spec.backoff_limit if spec.backoff_limit is not None else profile.backoff_limit,
        "max_restarts": profile.max_restarts,
        "rendezvous_port": profile.rendezvous_port,
        "rendezvous_endpoint": f"{spec.name}-0.{spec.name}:{profile.rendezvous_port}",
        "join_timeout_s": profile.rendezvous_join_timeout_s,
        "shutdown_timeout_s": launch["shutdown_timeout_s"],
        "grace_period_s": grace,
        "env_grace_s": env_grace,
        "metrics_port": metrics_port,
        "monitoring": monitoring,
        "trainer_args": trainer_args,
        "plan": plan,
        "planned_args": planned_args,
        "spot_args": spot_args,
        "launch_command": LAUNCH_COMMAND,
        "job_launch_args": launch["job"],
        "operator_launch_args": launch["pytorchjob"],
        "trainjob_launch_args": launch["trainjob"],
        "exit_preempted": EXIT_PREEMPTED,
        "exit_config": EXIT_CONFIG,
    }
    ctx["container_spec"] = _container_spec(ctx, ports=_ports(spec, profile, monitoring))
    return ctx


def _workload_context(spec: DeploySpec, profile: Profile, instance, grace: int, one_per_node: bool = True) -> dict[str, Any]:
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
        "container_security": _container_security(profile),
        "volumes": volumes,
        "volume_mounts": volume_mounts,
        "storage": storage,
        "output_root": output_root,
    }


def preprocess_context(spec: DeploySpec, profile: Profile) -> dict[str, Any]:
    """``--job preprocess``: ``data preprocess`` over ``spec.nodes`` pods of an Indexed Job,
    one share of the inputs each (its JOB_COMPLETION_INDEX), on CPU nodes: the profile's
    ``preprocess`` requests and limits, no GPU; the storage, identity and image of training."""
    from torchrec_cloud.launch import EXIT_CONFIG

    grace = spec.grace_period_s or profile.termination_grace_period_s
    # Shares are independent: several may share a node.
    ctx = _workload_context(spec, profile, None, grace, one_per_node=False)
    settings = profile.preprocess
    resources = {k: dict(settings[k]) for k in ("requests", "limits") if settings.get(k)}
    args = spec.preprocess_args(workers=_cpus(settings.get("requests", {}).get("cpu", "1")))
    identity = profile.identity or {}
    ctx.update({
        "pod_labels": {**ctx["labels"], **identity.get("pod_labels", {}), **profile.pod_labels},
        "pod_annotations": dict(profile.pod_annotations),
        "env": [],
        "resources": resources,
        "backoff_limit": spec.backoff_limit if spec.backoff_limit is not None else profile.backoff_limit,
        "preprocess_command": PREPROCESS_COMMAND,
        "preprocess_args": args,
        "exit_config": EXIT_CONFIG,
        "monitoring": None,
    })  # fmt: skip
    ctx["container_spec"] = _container_spec(ctx, ports=[])
    return ctx


def _cpus(quantity: Any) -> int:
    """Whole CPUs of a Kubernetes CPU quantity ("8", "7500m"), at least 1."""
    text = str(quantity)
    value = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    return max(int(value), 1)


def _plan(spec: DeploySpec, profile: Profile, instance, trainer_args: list[str]) -> tuple[Optional[dict], list[str]]:
    """TorchRec's plan for the job's GPUs (``torchrec-cloud plan``; raises ``DoesNotFit``
    when the cluster cannot hold the model) and the trainer flags it adds: the planned
    ``--embedding_kernel``, unless the user gave one."""
    from torchrec_cloud.plan import deploy_plan

    plan = deploy_plan(spec, profile, instance, trainer_args)
    return plan, (["--embedding_kernel", plan["kernel_flag"]] if plan else [])


def _instance(spec: DeploySpec, profile: Profile):
    wants_instance = spec.instance_type is not None or spec.gpus_per_node > 0
    instance = profile.instance(spec.instance_type) if wants_instance else None
    if instance is not None and instance.gpus and spec.gpus_per_node > instance.gpus:
        raise ConfigError(
            "gpus_per_node", f"{instance.name} has {instance.gpus} GPUs, asked for {spec.gpus_per_node}"
        )
    return instance


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
    pod_spec: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
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


def _resources(spec: DeploySpec, profile: Profile, instance) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if spec.gpus_per_node:
        limits[profile.gpu_resource] = spec.gpus_per_node
        if instance is not None:
            limits.update(instance.extra_resources)
            rdma = profile.request_rdma if spec.rdma is None else spec.rdma
            if rdma:
                limits.update(instance.rdma_resources)
    if instance is not None and spec.gpus_per_node == instance.gpus:
        # Whole machines: ask for most of the node so nothing else lands beside the trainer,
        # and cap its memory there (a leak is then an OOM kill, not a node-pressure eviction).
        requests.update(instance.requests)
        limits.update(instance.limits)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _container_security(profile: Profile) -> dict[str, Any]:
    security: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if profile.container_capabilities:
        security["capabilities"] = {"add": list(profile.container_capabilities)}
    return security


def _ports(spec: DeploySpec, profile: Profile, monitoring) -> list[dict[str, Any]]:
    ports = list(monitoring.container_ports)
    if spec.launcher == "job":
        # The operators pick their own rendezvous ports; the Indexed Job uses this one.
        ports.append({"name": "rendezvous", "containerPort": profile.rendezvous_port, "protocol": "TCP"})
    return ports


def _container_spec(ctx: dict[str, Any], ports: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {"ports": ports} if ports else {}
    if ctx["resources"]:
        container["resources"] = ctx["resources"]
    container["securityContext"] = ctx["container_security"]
    container["volumeMounts"] = ctx["volume_mounts"]
    return container


def _launch_args(spec: DeploySpec, profile: Profile, grace: int, trainer_args: list[str]) -> dict[str, Any]:
    """`torchrec-cloud launch` flags per launcher. The Indexed Job names the whole rendezvous;
    PyTorchJob's operator sets PET_NNODES/PET_RDZV_* itself; Kubeflow Trainer sets only
    PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and node 0's address (for torchrun's static
    rendezvous, which cannot re-form a group after a restart), so its c10d flags are here."""
    shutdown_timeout = max(grace - profile.shutdown_margin_s, 10)
    timeouts = f"join_timeout={profile.rendezvous_join_timeout_s},read_timeout={profile.rendezvous_join_timeout_s}"
    restarts = [f"--max_restarts={profile.max_restarts}", f"--shutdown_timeout={shutdown_timeout}",
                f"--peer_timeout_s={profile.peer_timeout_s if spec.peer_timeout_s is None else spec.peer_timeout_s}"]
    train = ["-m", "torchrec_cloud", "train", *trainer_args]
    rendezvous = ["--rdzv_backend=c10d", f"--rdzv_id={spec.name}", f"--rdzv_conf={timeouts}"]
    return {
        "shutdown_timeout_s": shutdown_timeout,
        "job": [
            f"--nnodes={spec.nodes}",
            f"--nproc_per_node={spec.procs}",
            *rendezvous,
            f"--rdzv_endpoint={spec.name}-0.{spec.name}:{profile.rendezvous_port}",
            *restarts,
            *train,
        ],
        "pytorchjob": [*restarts, *train],
        "trainjob": [*rendezvous, "--rdzv_endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", *restarts, *train],
    }


def _monitoring(spec: DeploySpec, profile: Profile, port: int):
    """What the profile's metrics collector needs for this job (pod metadata, ports, trainer
    flags, objects to apply), from the one copy of that data (deploy/monitoring.py)."""
    from torchrec_cloud.deploy.monitoring import monitoring_profile

    settings = profile.monitoring
    try:
        return monitoring_profile(
            settings["profile"],
            job_name=spec.name,
            namespace=spec.namespace,
            port=port,
            nproc_per_node=spec.procs,
            scrape_interval=str(settings["scrape_interval"]),
            cluster_wide=spec.cluster_monitoring,
        )
    except ConfigError:
        raise  # a port range past 65535: the user's flag, named
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(
            f"profile {profile.name!r}: monitoring must be {{profile: NAME, scrape_interval: 30s}} "
            f"with NAME an entry of monitoring_profiles.yaml.j2; got {settings!r} ({e})"
        ) from e


def render_documents(spec: DeploySpec, profile: Optional[Profile] = None) -> list[str]:
    """The bundle for ``spec.launcher``, one YAML document (text) per template and per object
    the metrics collector needs."""
    from torchrec_cloud.deploy.schedulable import require_schedulable

    ctx = build_context(spec, profile)
    if spec.job == "preprocess":
        docs = [render_template(name, **ctx) for name in PREPROCESS_TEMPLATES]
    else:
        docs = [render_template(name, **ctx) for name in LAUNCHER_TEMPLATES[spec.launcher]]
        docs += [render_template("collector.yaml.j2", manifest=m, **ctx) for m in ctx["monitoring"].manifests]
    docs += [render_template(name, **ctx) for name in ctx["profile"].extra_templates]
    docs = [doc.strip("\n") + "\n" for doc in docs]
    # A pod asking for a device nothing advertises where it may land stays Pending for good.
    require_schedulable(load_documents("---\n".join(docs)), ctx["profile"], spec.spot)
    return docs


def render_bundle(spec: DeploySpec, profile: Optional[Profile] = None) -> str:
    """Multi-document YAML for ``kubectl apply -f -``; raises ``AdmissionError`` (one line
    naming the flag) for a bundle a cluster would refuse."""
    from torchrec_cloud.deploy.admission import check_or_raise

    text = "---\n".join(render_documents(spec, profile))
    check_or_raise(load_documents(text))
    return text


def render_storage(spec: DeploySpec, profile: Optional[Profile] = None) -> Optional[str]:
    """PersistentVolume + claim for the profile's shared file system (None if it has none)."""
    ctx = build_context(spec, profile)
    if not ctx["storage"]:
        return None
    return render_template(ctx["storage"]["template"], **ctx)


def load_documents(text: str) -> list[dict[str, Any]]:
    """Parse multi-document YAML, dropping empty documents."""
    return [d for d in yaml.safe_load_all(text) if d]
