"""Cloud profiles: everything that differs between clusters, as data.

A profile is a YAML file in ``profiles/`` (``generic``, ``aws``, ``azure``, ``gcp``) laid over
``profiles/base.yaml``: NCCL/EFA/InfiniBand/TCPX environment, node selectors and
tolerations, GPU and network-device resource names, the storage volume, the workload
identity annotation, which collector scrapes the metrics (``monitoring``: a key into
``deploy/monitoring_profiles.yaml.j2``, the one copy of that data), instance facts (used by the manifests *and* the docs), cluster
defaults. The templates read a :class:`Profile`; no code branches on a cloud's name, so a
new cloud is a new YAML file::

    profile = load_profile("aws")
    profile.instance("p5.48xlarge").extra_resources   # {"vpc.amazonaws.com/efa": 32}
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from torchrec_cloud.config import ConfigError

PROFILE_DIR = "profiles"


class ProfileError(ValueError):
    """A profile file that cannot be used (unknown key, missing instance, bad YAML)."""


@dataclass(frozen=True)
class Instance:
    """One machine type a profile knows: facts for the docs, requests for the pods."""

    name: str
    gpus: int = 0
    gpu: str = ""
    gpu_memory_gb: float = 0
    """Memory of each GPU in GiB, for ``torchrec-cloud plan`` and the plan render makes first."""
    accelerator: str = ""
    vertex_accelerator: str = ""
    fixed_gpus: bool = False
    """The machine type comes with exactly ``gpus`` GPUs (GCP's A2/A3: "each A2/A3 machine type
    has a fixed GPU count", Compute Engine's GPU machine types), so an API that takes an
    accelerator count (Vertex AI's MachineSpec) refuses any other."""
    vcpus: int = 0
    memory: str = ""
    network: str = ""
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    """Limits of a whole-machine pod (memory: a leak is then an OOM kill of the container,
    not a node-pressure eviction, which restarts it uncounted)."""
    extra_resources: dict[str, int] = field(default_factory=dict)
    rdma_resources: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def capacity(self, resource: str, gpu_resource: str) -> int:
        """How many of an extended resource one machine has (0: none)."""
        if resource == gpu_resource:
            return self.gpus
        return {**self.extra_resources, **self.rdma_resources}.get(resource, 0)


@dataclass(frozen=True)
class Profile:
    """A cloud (or any cluster) as data; see ``profiles/base.yaml`` for what each key means."""

    name: str
    title: str
    kubernetes: str
    rendezvous_port: int
    rendezvous_join_timeout_s: int
    max_restarts: int
    termination_grace_period_s: int
    shutdown_margin_s: int
    backoff_limit: int
    peer_timeout_s: int
    lost_node: dict[str, float]
    metrics_port: int
    monitoring: dict[str, Any]
    shm_size: str
    gpu_resource: str
    instance_label: str
    pod_labels: dict[str, str]
    pod_annotations: dict[str, str]
    extra_templates: list[str]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    spot: dict[str, Any]
    env: dict[str, str]
    container_capabilities: list[str]
    identity: Optional[dict[str, Any]]
    storage: Optional[dict[str, Any]]
    default_instance: Optional[str]
    instances: dict[str, Instance]
    cluster: dict[str, Any] = field(default_factory=dict)
    image_registry: str = ""
    object_store: str = ""
    request_rdma: bool = False
    placeholders: list[str] = field(default_factory=list)
    gpu_nodes: Optional[dict[str, Any]] = None
    node_daemons: list[dict[str, Any]] = field(default_factory=list)
    extended_resource_toleration: bool = False
    managed_training: Optional[dict[str, Any]] = None
    preprocess: dict[str, Any] = field(default_factory=dict)
    process_resources: dict[str, Any] = field(default_factory=dict)
    rdma_capabilities: list[str] = field(default_factory=list)
    network_policy: dict[str, Any] = field(default_factory=dict)
    serving: dict[str, Any] = field(default_factory=dict)

    def instance(self, name: Optional[str] = None) -> Optional[Instance]:
        """The named instance type (default: the profile's), or None for a generic cluster."""
        name = name or self.default_instance
        if name is None:
            return None
        if name not in self.instances:
            known = ", ".join(sorted(self.instances)) or "none"
            raise ConfigError(
                "instance_type", f"profile {self.name!r} has no instance {name!r} (known: {known})"
            )
        return self.instances[name]

    def reclaim_grace_s(self) -> int:
        """Seconds a spot reclaim leaves a pod before SIGKILL (the kubelet gives a pod the
        shorter of this and its terminationGracePeriodSeconds)."""
        return int(self.spot["reclaim_grace_s"])

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# What a --set value may hold: ids, addresses, names and paths. It goes into YAML unquoted
# (the PersistentVolume's volumeHandle, server, path), so nothing that YAML would read as
# more than one plain scalar.
_SET_VALUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")


def with_values(profile: Profile, assignments: Sequence[str]) -> Profile:
    """``profile`` with ``KEY=VALUE`` assignments (``render --set``): KEY is a dotted path to a
    value the profile already has (``storage.nfs_server``), so a typo is refused, naming what
    is there; the file on disk is left alone."""
    data = copy.deepcopy(dataclasses.asdict(profile))
    for assignment in assignments:
        key, eq, value = assignment.partition("=")
        if not eq or not _SET_VALUE.match(value):
            raise ConfigError("set", f"expected KEY=VALUE with a value of letters, digits and . _ / : @ + -, "
                                     f"got {assignment!r}")  # fmt: skip
        *parents, leaf = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node or isinstance(node[leaf], (dict, list)):
            where = f"under {'.'.join(parents)}" if parents else "at the top"
            known = sorted(k for k, v in node.items() if not isinstance(v, (dict, list))) if isinstance(node, dict) else []
            raise ConfigError("set", f"profile {profile.name!r} has no value {key!r}"
                                     + (f" ({where}: {', '.join(known)})" if known else ""))  # fmt: skip
        node[leaf] = type(node[leaf])(value) if isinstance(node[leaf], (int, float)) else value
    data["instances"] = {name: Instance(**inst) for name, inst in data["instances"].items()}
    return Profile(**data)


def profile_names() -> list[str]:
    """Names of the profiles shipped with the package (``base`` is not one)."""
    folder = resources.files("torchrec_cloud.deploy").joinpath(PROFILE_DIR)
    return sorted(
        p.name[: -len(".yaml")]
        for p in folder.iterdir()
        if p.name.endswith(".yaml") and p.name != "base.yaml"
    )


def _read(name: str) -> dict[str, Any]:
    if name.endswith(".yaml"):  # a profile file of the user's own
        ref: Any = Path(name)
    else:
        ref = resources.files("torchrec_cloud.deploy").joinpath(PROFILE_DIR, f"{name}.yaml")
    try:
        text = ref.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(
            "cloud", f"no profile {name!r} (known: {', '.join(profile_names())})"
        ) from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ProfileError(f"{PROFILE_DIR}/{name}.yaml: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ProfileError(f"{PROFILE_DIR}/{name}.yaml: must be a mapping of keys to values")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Maps merge key by key; everything else (lists, scalars) in ``over`` replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# Variables read only by a network plugin that runs beside pods on the host network, which no
# manifest here renders (the restricted Pod Security Standard every bundle meets forbids
# hostNetwork and privileged containers: docs/security.md). GKE's GPUDirect-TCPX needs pods
# with hostNetwork: true, the privileged tcpx daemon beside them and the plugin's mounts
# (/usr/local/tcpx, /run/tcpx; Google's A3 guide); without them NCCL uses sockets and these
# variables only say otherwise.
HOST_NETWORK_ENV = ("NCCL_GPUDIRECTTCPX_",)


def _no_host_network_env(name: str, env: dict[str, Any], instances: dict[str, Instance]) -> None:
    for where, names in (("env", env), *((f"instance {i!r} env", inst.env) for i, inst in instances.items())):
        bad = sorted(k for k in names if k.startswith(HOST_NETWORK_ENV))
        if bad:
            raise ProfileError(
                f"{PROFILE_DIR}/{name}.yaml: {where} sets {', '.join(bad)}: GPUDirect-TCPX needs pods on the host "
                "network (hostNetwork: true) beside the cluster's privileged tcpx daemon, which these manifests do not "
                "render; NCCL would use sockets whatever they say (docs/deploy.md, \"NCCL transports\")"
            )


def load_profile(name: str) -> Profile:
    """Load ``profiles/<name>.yaml`` (or a path ending in ``.yaml``) over ``profiles/base.yaml``."""
    data = _merge(_read("base"), _read(name))
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(
            f"{PROFILE_DIR}/{name}.yaml: unknown key(s) {unknown}; known keys: {sorted(known)}"
        )
    instance_fields = {f.name for f in dataclasses.fields(Instance)} - {"name"}
    instances = {}
    for inst_name, inst in (data.get("instances") or {}).items():
        bad = sorted(set(inst) - instance_fields)
        if bad:
            raise ProfileError(
                f"{PROFILE_DIR}/{name}.yaml: instance {inst_name!r} has unknown key(s) {bad}"
            )
        instances[inst_name] = Instance(name=inst_name, **inst)
    data["instances"] = instances
    _no_host_network_env(name, data.get("env") or {}, instances)
    try:
        return Profile(**data)
    except TypeError as e:
        raise ProfileError(f"{PROFILE_DIR}/{name}.yaml: {e}") from e
