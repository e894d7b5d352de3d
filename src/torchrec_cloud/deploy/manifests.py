"""Kubernetes manifests from one set of Jinja2 templates and a cloud profile.

:func:`build_context` turns a :class:`DeploySpec` and a :class:`Profile` into plain values
(labels, node selector, env, volumes, the torchrun command); the templates in
``templates/`` only lay them out. Each launcher is a list of templates::

    job         Namespace, ServiceAccount, headless Service, Indexed Job
    pytorchjob  Namespace, ServiceAccount, Kubeflow v1 PyTorchJob
    trainjob    Namespace, ServiceAccount, Kubeflow Trainer v2 TrainJob

followed by the objects the cluster's metrics collector needs (the profile's ``monitoring``
key picks them from :func:`torchrec_cloud.deploy.monitoring.monitoring_profile`, which also
gives the pod labels, annotations, metrics container ports and trainer flags)::

    text = render_bundle(DeploySpec(cloud="generic", nodes=2, gpus_per_node=8))
    docs = list(yaml.safe_load_all(text))
"""

from __future__ import annotations

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
    "trainjob": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "trainjob.yaml.j2"],
}
# A TrainJob's runtime patches cannot add container ports (its CRD allows only env, name,
# securityContext and volumeMounts there), so its metrics ports stay undeclared.
LAUNCHERS_WITHOUT_CONTAINER_PORTS = {"trainjob"}
SERVICE_ACCOUNT = "torchrec-trainer"
JOB_LABEL = "torchrec-cloud/job"
# Where the trainer writes metrics.jsonl when no shared file system is mounted.
LOCAL_OUTPUT_ROOT = "/workspace/runs"


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
    return env


def render_template(template: str, /, **context: Any) -> str:
    return environment().get_template(template).render(**context)


def _arg_lines(args: list[str]) -> list[str]:
    """Shell-quoted trainer flags, one ``--flag value`` pair per line."""
    lines: list[str] = []
    for arg in args:
        if lines and not arg.startswith("--") and " " not in lines[-1]:
            lines[-1] += " " + shlex.quote(arg)
        else:
            lines.append(shlex.quote(arg))
    return lines


def build_context(spec: DeploySpec, profile: Optional[Profile] = None) -> dict[str, Any]:
    """Every value the templates use, computed from the spec and the profile's data."""
    profile = profile or load_profile(spec.cloud)
    wants_instance = spec.instance_type is not None or spec.gpus_per_node > 0
    instance = profile.instance(spec.instance_type) if wants_instance else None
    if instance is not None and instance.gpus and spec.gpus_per_node > instance.gpus:
        raise ConfigError(
            "gpus_per_node", f"{instance.name} has {instance.gpus} GPUs, asked for {spec.gpus_per_node}"
        )

    common_labels = {"app.kubernetes.io/name": "torchrec-cloud", "app.kubernetes.io/part-of": "torchrec-cloud"}
    selector = {JOB_LABEL: spec.name}
    labels = {**common_labels, "app.kubernetes.io/instance": spec.name, **selector}
    identity = profile.identity or {}
    metrics_port = spec.user_prometheus_port() or profile.metrics_port
    ports_declared = spec.launcher not in LAUNCHERS_WITHOUT_CONTAINER_PORTS
    monitoring = _monitoring(spec, profile, metrics_port, ports_declared)
    pod_labels = {**labels, **identity.get("pod_labels", {}), **monitoring.pod_labels, **profile.pod_labels}
    pod_annotations = {**monitoring.pod_annotations, **profile.pod_annotations}

    node_selector = dict(profile.node_selector)
    tolerations = list(profile.tolerations)
    if instance is not None:
        node_selector[profile.instance_label] = instance.name
    if spec.spot:
        node_selector.update(profile.spot.get("node_selector", {}))
        tolerations += profile.spot.get("tolerations", [])
    affinity = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": selector}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }

    grace = spec.grace_period_s or profile.termination_grace_period_s
    pod_spec: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    pod_spec["affinity"] = affinity

    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size or profile.shm_size}}
    ]
    volume_mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    storage = profile.storage if spec.storage else None
    output_root = LOCAL_OUTPUT_ROOT
    if storage:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": storage["claim_name"]}})
        volume_mounts.append({"name": "data", "mountPath": storage["mount_path"]})
        output_root = f"{storage['mount_path']}/runs"

    env_map = dict(profile.env)
    if instance is not None:
        env_map.update(instance.env)
    env = [{"name": k, "value": str(v)} for k, v in env_map.items()]

    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if spec.gpus_per_node:
        limits[profile.gpu_resource] = spec.gpus_per_node
        if instance is not None:
            limits.update(instance.extra_resources)
    if instance is not None and spec.gpus_per_node == instance.gpus:
        # Whole machines: ask for most of the node so nothing else lands beside the trainer.
        requests.update(instance.requests)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits

    ports = list(monitoring.container_ports) if ports_declared else []
    if spec.launcher == "job":
        # The operators pick their own rendezvous ports; the Indexed Job uses this one.
        ports.append({"name": "rendezvous", "containerPort": profile.rendezvous_port, "protocol": "TCP"})
    container_security: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if profile.container_capabilities:
        container_security["capabilities"] = {"add": list(profile.container_capabilities)}
    container_spec: dict[str, Any] = {"ports": ports}
    if resources:
        container_spec["resources"] = resources
    container_spec["securityContext"] = container_security
    container_spec["volumeMounts"] = volume_mounts

    trainer_args = spec.trainer_args(output_root, monitoring.container_args)
    shutdown_timeout = max(grace - profile.shutdown_margin_s, 10)
    operator_torchrun_args = [
        f"--max_restarts={profile.max_restarts}",
        f"--shutdown_timeout={shutdown_timeout}",
        "-m",
        "torchrec_cloud",
        "train",
        *trainer_args,
    ]
    sa_annotations = {}
    if identity:
        sa_annotations[identity["annotation"]] = spec.identity or identity["example"]
        identity_note = f"{identity['annotation']} grants cloud access without keys in the manifest."
    else:
        identity_note = "No cloud identity: add your cluster's workload-identity annotation here."

    ctx: dict[str, Any] = {
        "spec": spec,
        "profile": profile,
        "instance": instance,
        "name": spec.name,
        "namespace": spec.namespace,
        "image": spec.image,
        "nodes": spec.nodes,
        "procs": spec.procs,
        "world_size": spec.world_size,
        "common_labels": common_labels,
        "labels": labels,
        "selector": selector,
        "pod_labels": pod_labels,
        "pod_annotations": pod_annotations,
        "service_account": SERVICE_ACCOUNT,
        "service_account_annotations": sa_annotations,
        "identity_note": identity_note,
        "pod_spec": pod_spec,
        "container_spec": container_spec,
        "container_security": container_security,
        "env": env,
        "resources": resources,
        "volumes": volumes,
        "volume_mounts": volume_mounts,
        "storage": storage,
        "backoff_limit": spec.backoff_limit if spec.backoff_limit is not None else profile.backoff_limit * spec.nodes,
        "max_restarts": profile.max_restarts,
        "rendezvous_port": profile.rendezvous_port,
        "rendezvous_endpoint": f"{spec.name}-0.{spec.name}:{profile.rendezvous_port}",
        "join_timeout_s": profile.rendezvous_join_timeout_s,
        "shutdown_timeout_s": shutdown_timeout,
        "grace_period_s": grace,
        "metrics_port": metrics_port,
        "monitoring": monitoring,
        "trainer_args": trainer_args,
        "trainer_arg_lines": _arg_lines(trainer_args),
        "operator_torchrun_args": operator_torchrun_args,
        # The TrainJob runtime uses torchrun's static rendezvous; its store timeout defaults
        # to 10 minutes, shorter than node 0's image pull may take.
        "trainjob_torchrun_args": [
            f"--rdzv_conf=timeout={profile.rendezvous_join_timeout_s}",
            *operator_torchrun_args,
        ],
    }
    ctx["launch_script"] = render_template("launch_job.sh.j2", **ctx).rstrip("\n")
    return ctx


def _monitoring(spec: DeploySpec, profile: Profile, port: int, ports_declared: bool):
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
            ports_declared=ports_declared,
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
    ctx = build_context(spec, profile)
    docs = [render_template(name, **ctx) for name in LAUNCHER_TEMPLATES[spec.launcher]]
    docs += [render_template("collector.yaml.j2", manifest=m, **ctx) for m in ctx["monitoring"].manifests]
    docs += [render_template(name, **ctx) for name in ctx["profile"].extra_templates]
    return [doc.strip("\n") + "\n" for doc in docs]


def render_bundle(spec: DeploySpec, profile: Optional[Profile] = None) -> str:
    """Multi-document YAML for ``kubectl apply -f -``."""
    return "---\n".join(render_documents(spec, profile))


def render_storage(spec: DeploySpec, profile: Optional[Profile] = None) -> Optional[str]:
    """PersistentVolume + claim for the profile's shared file system (None if it has none)."""
    ctx = build_context(spec, profile)
    if not ctx["storage"]:
        return None
    return render_template(ctx["storage"]["template"], **ctx)


def load_documents(text: str) -> list[dict[str, Any]]:
    """Parse multi-document YAML, dropping empty documents."""
    return [d for d in yaml.safe_load_all(text) if d]
