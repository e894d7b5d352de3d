"""``render --job serve``: `torchrec-cloud serve` replicas on a cluster, from the profile's
``serving`` data (profiles/base.yaml says what each key means)::

    torchrec-cloud render --job serve --cloud aws --model_url s3://your-bucket/models/q
    torchrec-cloud render --job serve --cloud gcp --model_url gs://your-bucket/models/q --autoscaler keda
    torchrec-cloud render --job serve --cloud azure --model_url az://models/q --gpus 1
    torchrec-cloud render --job serve --cloud generic --model_url /data/models/q --launcher kserve

The bundle (templates ``serve_*.yaml.j2``)::

    job (default)  Namespace, ServiceAccount, Deployment, Service, HorizontalPodAutoscaler
                   (autoscaling/v2, CPU) or with --autoscaler keda a KEDA ScaledObject (on the
                   replicas' in-flight requests), PodDisruptionBudget, NetworkPolicy
    kserve         Namespace, ServiceAccount, KServe InferenceService (raw deployment: its
                   controller makes the Deployment, Service and HPA), NetworkPolicy

Every replica runs ``torchrec-cloud serve MODEL_URL --name NAME --host 0.0.0.0 --port 8080``
(and the ``serve`` flags after ``--``), meets the restricted Pod Security Standard with no API
token, and is probed on the v2 health endpoints. A deleted replica keeps serving for
``serving.prestop_s`` (a preStop sleep) while the endpoint controllers and load balancers stop
sending to it, then drains on SIGTERM; its terminationGracePeriodSeconds covers both (the
sources are cited in profiles/base.yaml beside the values).
"""

from __future__ import annotations

from typing import Any

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.profiles import Profile, ProfileError
from torchrec_cloud.deploy.spec import DeploySpec

SERVE_COMMAND = ["torchrec-cloud", "serve"]
# The server's in-flight gauge (its metrics are served at /metrics on the HTTP port); KEDA's
# query sums it over the Deployment's pods, so its threshold is in-flight requests per pod.
INFLIGHT_METRIC = "torchrec_cloud_serve_inflight_requests"
LIVE_PATH, READY_PATH, METRICS_PATH = "/v2/health/live", "/v2/health/ready", "/metrics"
# KServe's raw deployment mode (no Knative): its controller makes a plain Deployment, Service
# and HPA, so the pods keep our probes, preStop and grace (kserve pkg/constants/constants.go,
# DeploymentMode; "Standard" is the newer name of the same mode, RawDeployment still read).
KSERVE_MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
KSERVE_CONTAINER = "kserve-container"

SERVE_TEMPLATES = {
    ("job", "hpa"): ["namespace.yaml.j2", "serviceaccount.yaml.j2", "serve_deployment.yaml.j2", "serve_service.yaml.j2",
                     "serve_hpa.yaml.j2", "serve_pdb.yaml.j2", "serve_networkpolicy.yaml.j2"],
    ("job", "keda"): ["namespace.yaml.j2", "serviceaccount.yaml.j2", "serve_deployment.yaml.j2", "serve_service.yaml.j2",
                      "serve_scaledobject.yaml.j2", "serve_pdb.yaml.j2", "serve_networkpolicy.yaml.j2"],
    ("kserve", "hpa"): ["namespace.yaml.j2", "serviceaccount.yaml.j2", "serve_inferenceservice.yaml.j2",
                        "serve_networkpolicy.yaml.j2"],
}  # fmt: skip


def serve_templates(spec: DeploySpec) -> list[str]:
    key = (spec.launcher, spec.autoscaler)
    if key not in SERVE_TEMPLATES:
        raise ConfigError("autoscaler", "--launcher kserve scales with KServe's own HPA: leave --autoscaler hpa")
    return SERVE_TEMPLATES[key]


def _setting(profile: Profile, key: str) -> Any:
    try:
        return profile.serving[key]
    except (KeyError, TypeError):
        raise ProfileError(f"profile {profile.name!r}: serving.{key} is missing (profiles/base.yaml has it)") from None


def serve_context(spec: DeploySpec, profile: Profile) -> dict[str, Any]:
    """Every value the ``serve_*`` templates use."""
    from torchrec_cloud.deploy.admission import MIN_KUBERNETES_ANNOTATION, MIN_OPERATORS_ANNOTATION, MIN_VERSIONS
    from torchrec_cloud.deploy.pod import _millicores, _network_policy, workload_context

    port = int(_setting(profile, "port"))
    prestop, drain, margin = (int(_setting(profile, k)) for k in ("prestop_s", "drain_s", "grace_margin_s"))
    grace = prestop + drain + margin
    instance = profile.instance(spec.instance_type) if spec.gpus else None
    if instance is not None and instance.gpus and spec.gpus > instance.gpus:
        raise ConfigError("gpus", f"{instance.name} has {instance.gpus} GPUs, asked for {spec.gpus}")
    ctx = workload_context(spec, profile, instance, grace, one_per_node=False)
    if storage.is_url(spec.model_url):  # read from its bucket: the shared file system is not needed
        ctx["volumes"] = [v for v in ctx["volumes"] if v["name"] != "data"]
        ctx["volume_mounts"] = [m for m in ctx["volume_mounts"] if m["name"] != "data"]
        ctx["storage"] = None
    shm = str(_setting(profile, "shm_size"))
    for volume in ctx["volumes"]:
        if volume["name"] == "dshm":
            volume["emptyDir"]["sizeLimit"] = shm
    versions = MIN_VERSIONS["kserve" if spec.launcher == "kserve" else f"serve-{spec.autoscaler}".replace("-hpa", "")]
    ctx["workload_annotations"] = {MIN_KUBERNETES_ANNOTATION: versions["kubernetes"],
                                   **({MIN_OPERATORS_ANNOTATION: versions["operators"]} if versions["operators"] else {})}
    min_replicas = spec.min_replicas or int(_setting(profile, "min_replicas"))
    max_replicas = spec.max_replicas or max(int(_setting(profile, "max_replicas")), min_replicas)
    if min_replicas > max_replicas:
        raise ConfigError("min_replicas", f"{min_replicas} is more than --max_replicas {max_replicas}")
    identity = profile.identity or {}
    # A CPU replica runs a worker process per whole CPU of its request (one event loop parses
    # every request of its process), unless the flags after '--' say --workers; a GPU replica
    # one, which feeds the GPU (a worker each would hold a copy of the tables on it).
    workers = spec.serve_workers()
    placement = ["--name", spec.name, "--host", "0.0.0.0", "--port", str(port)]
    if workers is None and not spec.gpus:
        workers = max(_millicores(_setting(profile, "requests")["cpu"], f"profile {profile.name!r}, serving") // 1000, 1)
        placement += ["--workers", str(workers)]
    args = [spec.model_url, *placement, *spec.train_args]
    container = {
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # Ready once the model is loaded and warmed, not ready from SIGTERM on (the server's own rules).
        "readinessProbe": {"httpGet": {"path": READY_PATH, "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        # Generous: a failed liveness probe restarts the container, dropping what it holds.
        "livenessProbe": {"httpGet": {"path": LIVE_PATH, "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        # Loading a large model takes longer than any liveness budget: the startup probe holds
        # the liveness probe off until the server first answers.
        "startupProbe": {"httpGet": {"path": LIVE_PATH, "port": "http"}, "periodSeconds": 5, "failureThreshold": 120},
        # The sleep action, not `exec sleep`: nothing has to be in the image (PodLifecycleSleepAction,
        # on by default since Kubernetes 1.30).
        "lifecycle": {"preStop": {"sleep": {"seconds": prestop}}},
        "resources": _resources(spec, profile, shm, workers or 1),
        "securityContext": ctx["container_security"],
        "volumeMounts": ctx["volume_mounts"],
    }
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": METRICS_PATH}
    selector = ctx["selector"]
    network_policy = _network_policy(spec, profile, None, 0, selector, ctx["labels"], peers=False)
    # Clients are anywhere in the cluster (and the cloud's load balancer, through the nodes):
    # the serving port is open; the pods take no other connection.
    network_policy["spec"]["ingress"] = [{"ports": [{"protocol": "TCP", "port": port}]}]
    ctx.update({
        "pod_labels": {**ctx["labels"], **identity.get("pod_labels", {}), **profile.pod_labels},
        "pod_annotations": {**scrape, **profile.pod_annotations},
        "env": [{"name": k, "value": str(v)} for k, v in (instance.env if instance is not None else {}).items()],
        "serve_command": SERVE_COMMAND,
        "serve_args": args,
        "port": port,
        "container_spec": container,
        "grace_period_s": grace,
        "prestop_s": prestop,
        "drain_s": drain,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "cpu_target_percent": int(_setting(profile, "cpu_target_percent")),
        "inflight_per_pod": int(_setting(profile, "inflight_per_pod")),
        "inflight_query": f'sum({INFLIGHT_METRIC}{{namespace="{spec.namespace}",pod=~"{spec.name}-.*"}})',
        "prometheus_address": str(_setting(profile, "prometheus_address")),
        "min_available": min(int(_setting(profile, "min_available")), min_replicas - 1) if min_replicas > 1 else 0,
        "network_policy": network_policy,
        "kserve_mode_annotation": KSERVE_MODE_ANNOTATION,
        "kserve_container": KSERVE_CONTAINER,
        "monitoring": None,
    })  # fmt: skip
    return ctx


def _resources(spec: DeploySpec, profile: Profile, shm: str, workers: int) -> dict[str, Any]:
    """A replica's cpu and memory requested and capped (limits default to the requests;
    /dev/shm, which counts against the memory limit, added to both), and its GPUs. A CPU at
    least for each of its ``workers``: under a smaller quota the kernel throttles them in
    turn, holding every request of a throttled worker's event loop. Requests equal to the
    limits make the pod Guaranteed (kubernetes ``pkg/apis/core/v1/helper/qos/qos.go``,
    ``GetPodQOS``), the only class whose whole CPUs the kubelet's static CPU manager gives
    to the container alone (``pkg/kubelet/cm/cpumanager/policy_static.go``,
    ``guaranteedCPUs``): otherwise the workers share their cores with other pods, and a
    request waits while another process holds its worker's core."""
    from torchrec_cloud.deploy.pod import _bytes, _cpu_text, _memory_text, _millicores

    where = f"profile {profile.name!r}, serving"
    requests = _setting(profile, "gpu_requests" if spec.gpus else "requests")
    given = {} if spec.gpus else (profile.serving.get("limits") or {})
    cpu = max(_millicores(requests["cpu"], where), 1000 * workers)
    shm_bytes = _bytes(shm, "cloud", where)
    memory = _bytes(requests["memory"], "cloud", where) + shm_bytes
    cpu_limit = max(_millicores(given["cpu"], where), cpu) if "cpu" in given else cpu
    memory_limit = _bytes(given["memory"], "cloud", where) + shm_bytes if "memory" in given else memory
    resources: dict[str, Any] = {
        "requests": {"cpu": _cpu_text(cpu), "memory": _memory_text(memory)},
        "limits": {"cpu": _cpu_text(cpu_limit), "memory": _memory_text(memory_limit)},
    }
    if spec.gpus:
        resources["limits"][profile.gpu_resource] = spec.gpus
    return resources
