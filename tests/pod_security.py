"""The Kubernetes "restricted" Pod Security Standard as a checker of rendered pod specs.

The rules as the API server's Pod Security Admission applies them at level ``restricted``
(which includes ``baseline``), from kubernetes/kubernetes
staging/src/k8s.io/pod-security-admission/policy/ (check_restrictedVolumes.go read at
b8ff6a45; the others by their names in that folder: check_hostNamespaces.go,
check_privileged.go, check_capabilities_restricted.go, check_hostPathVolumes.go,
check_restrictedVolumes.go, check_hostPorts.go, check_appArmorProfile.go,
check_seLinuxOptions.go, check_procMount.go, check_seccompProfile_restricted.go,
check_sysctls.go, check_allowPrivilegeEscalation.go, check_runAsNonRoot.go,
check_runAsUser.go, check_windowsHostProcess.go) and the kubernetes.io page ("Pod Security
Standards", as known, not re-read here). Each rule is one function returning what it finds; ``violations`` runs
them all on one pod spec::

    for spec in pod_specs(docs):
        assert violations(spec) == []
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

# check_restrictedVolumes.go: the inline volume sources the restricted level admits.
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}
# check_capabilities_restricted.go: what a container may add back after dropping ALL.
ALLOWED_ADD = {"NET_BIND_SERVICE"}
# check_seccompProfile_restricted.go, check_appArmorProfile.go.
ALLOWED_PROFILES = {"RuntimeDefault", "Localhost"}
# check_seLinuxOptions.go.
ALLOWED_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# check_sysctls.go (the safe set as of 1.32).
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _ctx(container: dict[str, Any]) -> dict[str, Any]:
    return container.get("securityContext") or {}


def host_namespaces(spec):
    return [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]


def privileged(spec):
    return [f"{c['name']}: privileged" for c in containers(spec) if _ctx(c).get("privileged")]


def host_process(spec):
    pod = (spec.get("securityContext") or {}).get("windowsOptions") or {}
    found = ["pod: hostProcess"] if pod.get("hostProcess") else []
    return found + [f"{c['name']}: hostProcess" for c in containers(spec)
                    if (_ctx(c).get("windowsOptions") or {}).get("hostProcess")]


def volumes(spec):
    bad = []
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds - ALLOWED_VOLUMES)}")
    return bad


def host_ports(spec):
    return [f"{c['name']}: hostPort {p['hostPort']}" for c in containers(spec) for p in c.get("ports") or []
            if p.get("hostPort")]


def _profile_type(ctx: dict[str, Any], key: str) -> Any:
    return (ctx.get(key) or {}).get("type")


def app_armor(spec):
    pod = _profile_type(spec.get("securityContext") or {}, "appArmorProfile")
    bad = [] if pod in (None, *ALLOWED_PROFILES) else [f"pod: appArmorProfile {pod}"]
    return bad + [f"{c['name']}: appArmorProfile {t}" for c in containers(spec)
                  if (t := _profile_type(_ctx(c), "appArmorProfile")) not in (None, *ALLOWED_PROFILES)]


def se_linux(spec):
    bad = []
    for where, ctx in [("pod", spec.get("securityContext") or {}), *((c["name"], _ctx(c)) for c in containers(spec))]:
        opts = ctx.get("seLinuxOptions") or {}
        if opts.get("type", "") not in ALLOWED_SELINUX_TYPES or opts.get("user") or opts.get("role"):
            bad.append(f"{where}: seLinuxOptions {opts}")
    return bad


def proc_mount(spec):
    return [f"{c['name']}: procMount {_ctx(c)['procMount']}" for c in containers(spec)
            if _ctx(c).get("procMount", "Default") != "Default"]


def sysctls(spec):
    return [f"sysctl {s['name']}" for s in (spec.get("securityContext") or {}).get("sysctls") or []
            if s["name"] not in SAFE_SYSCTLS]


def privilege_escalation(spec):
    return [f"{c['name']}: allowPrivilegeEscalation is not false" for c in containers(spec)
            if _ctx(c).get("allowPrivilegeEscalation") is not False]


def run_as_non_root(spec):
    pod = (spec.get("securityContext") or {}).get("runAsNonRoot")
    bad = ["pod: runAsNonRoot false"] if pod is False else []
    for c in containers(spec):
        mine = _ctx(c).get("runAsNonRoot")
        if mine is False or (mine is None and pod is not True):
            bad.append(f"{c['name']}: runAsNonRoot is not true")
    return bad


def run_as_user(spec):
    bad = ["pod: runAsUser 0"] if (spec.get("securityContext") or {}).get("runAsUser") == 0 else []
    return bad + [f"{c['name']}: runAsUser 0" for c in containers(spec) if _ctx(c).get("runAsUser") == 0]


def seccomp(spec):
    pod = _profile_type(spec.get("securityContext") or {}, "seccompProfile")
    bad = [] if pod in (None, *ALLOWED_PROFILES) else [f"pod: seccompProfile {pod}"]
    for c in containers(spec):
        mine = _profile_type(_ctx(c), "seccompProfile")
        if mine is not None and mine not in ALLOWED_PROFILES:
            bad.append(f"{c['name']}: seccompProfile {mine}")
        elif mine is None and pod is None:
            bad.append(f"{c['name']}: no seccompProfile (pod or container)")
    return bad


def capabilities(spec):
    bad = []
    for c in containers(spec):
        caps = _ctx(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{c['name']}: capabilities do not drop ALL")
        extra = set(caps.get("add") or []) - ALLOWED_ADD
        if extra:
            bad.append(f"{c['name']}: adds {sorted(extra)}")
    return bad


RULES: list[Callable[[dict[str, Any]], list[str]]] = [
    host_namespaces, privileged, host_process, volumes, host_ports, app_armor, se_linux, proc_mount, sysctls,
    privilege_escalation, run_as_non_root, run_as_user, seccomp, capabilities,
]


def violations(spec: dict[str, Any]) -> list[str]:
    """Every way ``spec`` (a pod spec) fails the restricted standard, as ``rule: what``."""
    return [f"{rule.__name__}: {found}" for rule in RULES for found in rule(spec)]
