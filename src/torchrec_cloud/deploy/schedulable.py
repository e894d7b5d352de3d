"""Can a rendered pod run on the cluster the guide builds? Its extended resources, placed.

A pod asking for ``vpc.amazonaws.com/efa`` or ``nvidia.com/gpu`` stays Pending unless a device
plugin advertises that resource on a node the pod may land on, and a device plugin is a
DaemonSet that lands only where its own tolerations and node affinity let it. A profile
describes both sides as data: ``gpu_nodes`` (the GPU pools' labels and taints, from the
cluster config and from the cloud) and ``node_daemons`` (what the cluster config or the guide
installs on them, each with its DaemonSet's tolerations and required node affinity, read
from the source it names). :func:`problems` places a pod spec with Kubernetes' own rules
(taints and tolerations, ``nodeSelector``, required node affinity, and the
ExtendedResourceToleration admission plugin where the cluster runs it) and says, one line
each, which extended resource it asks for that nothing advertises where it can run::

    problems(pod_spec, load_profile("aws"))         # [] when the pod can be scheduled
    check_documents(load_documents(text), profile)  # the same for every pod of a bundle

The rules, read from Kubernetes v1.33: a toleration matches a taint as in
``k8s.io/api/core/v1/toleration.go`` (``ToleratesTaint``); only ``NoSchedule`` and
``NoExecute`` taints keep a pod off; ``nodeSelectorTerms`` match when any term matches, a
term when every expression does, ``NotIn`` and ``DoesNotExist`` also on a node without the
label (``k8s.io/component-helpers/scheduling/corev1/nodeaffinity``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.profiles import Instance, Profile

# Taint effects the scheduler keeps a pod off for (PreferNoSchedule only scores).
_BLOCKING = ("NoSchedule", "NoExecute")
_NATIVE = ("cpu", "memory", "ephemeral-storage", "storage", "pods")


class Unschedulable(ConfigError):
    """A bundle whose pods would stay Pending on the cluster the profile describes."""


@dataclass(frozen=True)
class Node:
    """One GPU machine of the cluster: what the scheduler and the DaemonSets see of it."""

    instance: Instance
    spot: bool
    labels: dict[str, str]
    taints: list[dict[str, Any]]
    config_taints: list[dict[str, Any]] = field(default_factory=list)
    """The taints the cluster config sets (an installer may copy these into tolerations)."""

    @property
    def pool(self) -> str:
        return f"{self.instance.name} ({'spot' if self.spot else 'on-demand'})"


@dataclass(frozen=True)
class Problem:
    resource: Optional[str]
    """The extended resource nothing advertises, or None when the pod fits no node at all."""
    message: str


def _fill(labels: dict[str, Any], instance: Instance) -> dict[str, str]:
    fields = {k: v for k, v in vars(instance).items() if isinstance(v, (str, int, float))}
    return {k: str(v).format(**fields) for k, v in (labels or {}).items()}


def gpu_nodes(profile: Profile) -> list[Node]:
    """An on-demand and a spot node of every GPU instance type the profile knows."""
    data = profile.gpu_nodes
    if not data:
        return []
    nodes = []
    for instance in profile.instances.values():
        if not instance.gpus:
            continue
        for spot in (False, True):
            extra = (data.get("spot") or {}) if spot else {}
            labels = {profile.instance_label: instance.name, "kubernetes.io/os": "linux"}
            labels.update(_fill(data.get("labels"), instance))
            labels.update(_fill(data.get("cloud_labels"), instance))
            labels.update(_fill(extra.get("labels"), instance))
            labels.update(_fill(extra.get("cloud_labels"), instance))
            config = list(data.get("taints") or []) + list(extra.get("taints") or [])
            cloud = list(data.get("cloud_taints") or []) + list(extra.get("cloud_taints") or [])
            nodes.append(Node(instance, spot, labels, config + cloud, config))
    return nodes


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """``Toleration.ToleratesTaint`` (k8s.io/api/core/v1/toleration.go)."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and str(toleration.get("value", "")) == str(taint.get("value", ""))


def _taint(taint: dict[str, Any]) -> str:
    value = f"={taint['value']}" if taint.get("value") not in (None, "") else ""
    return f"{taint.get('key', '')}{value}:{taint.get('effect', '')}"


def untolerated(tolerations: list[dict[str, Any]], taints: list[dict[str, Any]]) -> list[str]:
    """The blocking taints no toleration matches, as ``key=value:Effect``."""
    return [_taint(t) for t in taints
            if t.get("effect") in _BLOCKING and not any(tolerates(tol, t) for tol in tolerations)]


def _expression(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], [str(v) for v in expr.get("values") or []]
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        try:
            have, bound = int(labels[key]), int(values[0])
        except (KeyError, ValueError, IndexError):
            return False
        return have > bound if op == "Gt" else have < bound
    raise ValueError(f"node selector operator {op!r} is not one Kubernetes knows")


def _expressions(term: Any) -> list[dict[str, Any]]:
    """A term as a pod writes it ({matchExpressions: [...]}) or as a profile does (a list)."""
    return term.get("matchExpressions") or [] if isinstance(term, dict) else list(term)


def selects(node_selector: dict[str, Any], terms: list[Any], labels: dict[str, str]) -> list[str]:
    """What keeps a node with ``labels`` out of a nodeSelector and required node affinity."""
    why = [f"label {k}={v}" for k, v in (node_selector or {}).items() if labels.get(k) != str(v)]
    if terms and not any(all(_expression(e, labels) for e in _expressions(t)) for t in terms):
        wanted = " or ".join(
            " and ".join(f"{e['key']} {e['operator']} {','.join(map(str, e.get('values') or []))}".rstrip()
                         for e in _expressions(t))
            for t in terms
        )
        why.append(f"node affinity ({wanted})")
    return why


def _required_terms(pod_spec: dict[str, Any]) -> list[Any]:
    affinity = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
    return (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []


def extended_requests(pod_spec: dict[str, Any]) -> dict[str, int]:
    """Extended resources the pod's containers ask for (limits stand for unset requests, as
    the API server's defaulting makes them)."""
    wanted: dict[str, int] = {}
    for container in pod_spec.get("containers") or []:
        resources = container.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in merged.items():
            native = name in _NATIVE or name.startswith(("hugepages-", "requests.")) or "kubernetes.io/" in name
            if not native and "/" in name:
                wanted[name] = wanted.get(name, 0) + int(value)
    return wanted


def _daemon_tolerations(daemon: dict[str, Any], node: Node) -> list[dict[str, Any]]:
    tolerations = list(daemon.get("tolerations") or [])
    if daemon.get("tolerates_gpu_node_taints"):
        # eksctl's NvidiaDevicePlugin.SetTolerations: {Key, Value} only, so operator Equal
        # and every effect.
        tolerations += [{"key": t["key"], "value": t.get("value", "")} for t in node.config_taints]
    return tolerations


def _why_not_there(daemon: dict[str, Any], node: Node, labels: dict[str, str]) -> list[str]:
    why = [f"does not tolerate the taint {t}" for t in untolerated(_daemon_tolerations(daemon, node), node.taints)]
    missing = selects(daemon.get("node_selector") or {}, daemon.get("node_affinity") or [], labels)
    why += [f"needs {m}" for m in missing]
    return why


def daemons_on(node: Node, daemons: list[dict[str, Any]]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The node's labels once the labelling daemons have run, and the daemons that run there
    (a label one daemon sets can let another in)."""
    labels = dict(node.labels)
    running: list[dict[str, Any]] = []
    changed = True
    while changed:
        changed = False
        for daemon in daemons:
            if daemon in running or _why_not_there(daemon, node, labels):
                continue
            running.append(daemon)
            for key, value in (daemon.get("labels") or {}).items():
                if labels.get(key) != str(value):
                    labels[key] = str(value)
                    changed = True
    return labels, running


def problems(pod_spec: dict[str, Any], profile: Profile) -> list[Problem]:
    """Why ``pod_spec`` would stay Pending on the profile's cluster; [] when it can run there
    (or when the profile describes no nodes)."""
    wanted = extended_requests(pod_spec)
    nodes = gpu_nodes(profile)
    if not wanted or not nodes:
        return []
    tolerations = list(pod_spec.get("tolerations") or [])
    if profile.extended_resource_toleration:
        tolerations += [{"key": r, "operator": "Exists", "effect": "NoSchedule"} for r in sorted(wanted)]
    selector, terms = pod_spec.get("nodeSelector") or {}, _required_terms(pod_spec)
    fits, misfits = [], []
    for node in nodes:
        why = [f"taint {t} not tolerated" for t in untolerated(tolerations, node.taints)]
        why += [f"no {m}" for m in selects(selector, terms, node.labels)]
        (misfits if why else fits).append((node, why))
    if not fits:
        # The pools the pod asks for by name, else all: why each one refuses it.
        named = [(n, w) for n, w in misfits if selector.get(profile.instance_label) in (None, n.instance.name)]
        detail = "; ".join(f"{n.pool}: {', '.join(w)}" for n, w in named or misfits)
        return [Problem(None, f"the pods fit no GPU node of the {profile.kubernetes} cluster the guide builds ({detail})")]
    best: Optional[list[Problem]] = None
    for node, _ in fits:
        labels, running = daemons_on(node, profile.node_daemons)
        found = []
        for resource, count in sorted(wanted.items()):
            capacity = node.instance.capacity(resource, profile.gpu_resource)
            advertisers = [d for d in running if resource in (d.get("resources") or [])]
            if advertisers and capacity >= count:
                continue
            if advertisers:
                found.append(Problem(resource, f"the pods ask for {count} {resource} per node; a {node.pool} node "
                                               f"has {capacity}"))
                continue
            candidates = [d for d in profile.node_daemons if resource in (d.get("resources") or [])]
            if not candidates:
                found.append(Problem(resource, f"the pods ask for {resource}, which nothing the cluster config or "
                                               f"the guide installs advertises"))
                continue
            why = "; ".join(f"{d['name']} ({d.get('installed_by', 'installed by the guide')}) "
                            f"{' and '.join(_why_not_there(d, node, labels))}" for d in candidates)
            found.append(Problem(resource, f"the pods ask for {resource}, which is advertised on no {node.pool} "
                                           f"node: {why}"))
        if not found:
            return []
        if best is None or len(found) < len(best):
            best = found
    return best or []


def pod_specs(doc: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec (a mapping with ``containers``) inside a Kubernetes object."""
    if isinstance(doc, dict):
        if isinstance(doc.get("containers"), list):
            yield doc
            return
        for value in doc.values():
            yield from pod_specs(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from pod_specs(value)


def check_documents(docs: list[dict[str, Any]], profile: Profile) -> list[Problem]:
    """:func:`problems` of every pod a bundle would create (the first pod's, when they agree)."""
    seen: list[Problem] = []
    for spec in pod_specs(docs):
        for problem in problems(spec, profile):
            if problem not in seen:
                seen.append(problem)
    return seen


def require_schedulable(docs: list[dict[str, Any]], profile: Profile, spot: bool) -> None:
    """Raise :class:`Unschedulable` naming the flag to change (``--rdma`` for an RDMA device,
    ``--spot`` for a spot job, else ``--instance_type``) when a pod could not run."""
    found = check_documents(docs, profile)
    if not found:
        return
    rdma = {r for i in profile.instances.values() for r in i.rdma_resources}
    flag = "rdma" if any(p.resource in rdma for p in found) else "spot" if spot else "instance_type"
    raise Unschedulable(flag, "; ".join(p.message for p in found)
                        + " (the profile's gpu_nodes and node_daemons; docs/deploy.md, \"Where the pods can run\")")
