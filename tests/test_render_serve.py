"""``render --job serve``: every cloud's serving bundle is valid against Kubernetes' schemas
(kubernetes-validate, strict) and the KEDA and KServe CRDs (tests/schemas/), admitted by
deploy/admission.py, hardened as every other pod (restricted Pod Security Standard, no API
token), and wired: probes on the v2 health endpoints, a preStop sleep inside the grace, the
Service, autoscaler and budget on the Deployment's pods."""

from __future__ import annotations

import copy

import pytest

from test_deploy import cli, fake_kubectl  # noqa: F401 - cli is a fixture
from test_render import CLOUDS, assert_hardened, by_kind, render, validate
from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy import admission
from torchrec_cloud.deploy.manifests import load_documents, render_bundle
from torchrec_cloud.deploy.pod import _bytes, _millicores
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.serving import INFLIGHT_METRIC
from torchrec_cloud.deploy.spec import DeploySpec

MODEL = "s3://bucket/models/q"
KINDS = {
    "hpa": ["Namespace", "ServiceAccount", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "NetworkPolicy"],
    "keda": ["Namespace", "ServiceAccount", "Deployment", "Service", "ScaledObject", "PodDisruptionBudget",
             "NetworkPolicy"],
    "kserve": ["Namespace", "ServiceAccount", "InferenceService", "NetworkPolicy"],
}  # fmt: skip


def serve(**kw) -> list[dict]:
    return render(job="serve", model_url=kw.pop("model_url", MODEL), **kw)


def checked(docs: list[dict]) -> list[dict]:
    for doc in docs:
        validate(doc)
    assert admission.check(docs) == []
    assert_hardened(docs)
    return docs


def the_pod(docs: list[dict]) -> dict:
    for doc in docs:
        if doc["kind"] == "Deployment":
            return doc["spec"]["template"]["spec"]
        if doc["kind"] == "InferenceService":
            return doc["spec"]["predictor"]
    raise AssertionError("no serving pod")


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("variant", ["hpa", "keda", "kserve"])
def test_every_cloud_renders_a_valid_admitted_serving_bundle(cloud, variant):
    kw = {"launcher": "kserve"} if variant == "kserve" else {"autoscaler": variant}
    docs = checked(serve(cloud=cloud, **kw))
    assert [d["kind"] for d in docs] == KINDS[variant]
    pod = the_pod(docs)
    (container,) = pod["containers"]
    assert container["command"] == ["torchrec-cloud", "serve"]
    port = load_profile(cloud).serving["port"]
    assert container["args"][:7] == [MODEL, "--name", "torchrec-serve", "--host", "0.0.0.0", "--port", str(port)]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    # SIGTERM comes only after the preStop sleep, out of the same grace: the server keeps
    # time to drain after the endpoints stop naming it.
    prestop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert prestop > 0 and pod["terminationGracePeriodSeconds"] >= prestop + load_profile(cloud).serving["drain_s"]
    assert "data" not in [v["name"] for v in pod["volumes"]]  # a bucket URL needs no shared file system
    policy = by_kind(docs, "NetworkPolicy")["spec"]
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": port}]}]


def test_the_service_autoscaler_and_budget_select_the_deployments_pods():
    docs = checked(serve(cloud="generic", min_replicas=3, max_replicas=7))
    deployment = by_kind(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        spec = by_kind(docs, kind)["spec"]
        selector = spec["selector"] if kind == "Service" else spec.get("selector", spec.get("podSelector"))["matchLabels"]
        assert selector.items() <= labels.items(), kind
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 7)
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"
    assert by_kind(docs, "PodDisruptionBudget")["spec"]["minAvailable"] < 3  # a drain can always proceed
    service = by_kind(docs, "Service")["spec"]
    assert service["ports"][0]["targetPort"] == "http"


def test_keda_scales_on_in_flight_requests_per_pod():
    docs = checked(serve(cloud="gcp", autoscaler="keda"))
    (trigger,) = by_kind(docs, "ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert INFLIGHT_METRIC in trigger["metadata"]["query"] and 'namespace="torchrec"' in trigger["metadata"]["query"]
    assert int(trigger["metadata"]["threshold"]) == load_profile("gcp").serving["inflight_per_pod"]
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes its own


def test_gpu_replicas_ask_for_gpus_on_the_gpu_nodes():
    docs = checked(serve(cloud="aws", gpus=1))
    pod = the_pod(docs)
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    profile = load_profile("aws")
    assert pod["nodeSelector"][profile.instance_label] == profile.default_instance
    cpu = the_pod(checked(serve(cloud="aws")))
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"] and "nodeSelector" not in cpu
    checked(serve(cloud="gcp", gpus=1, launcher="kserve"))


def the_server(pod: dict) -> tuple[list[str], dict]:
    (container,) = pod["containers"]
    return container["args"], container["resources"]


def qos_class(pod: dict) -> str:
    """The pod's QoS class by the kubelet's rule (kubernetes
    ``pkg/apis/core/v1/helper/qos/qos.go``, ``GetPodQOS``, read at 0c4236dd): cpu and memory
    only, summed over the containers and init containers; Guaranteed when every container has
    both limits and the requests equal the limits."""
    amount = {"cpu": lambda q: _millicores(q, "test"), "memory": lambda q: _bytes(q, "memory", "test")}
    requests: dict[str, int] = {}
    limits: dict[str, int] = {}
    guaranteed = True
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        resources = container.get("resources", {})
        for kind, total in (("requests", requests), ("limits", limits)):
            for name, quantity in resources.get(kind, {}).items():
                if name in amount and amount[name](quantity) > 0:
                    total[name] = total.get(name, 0) + amount[name](quantity)
        limited = {n for n, q in resources.get("limits", {}).items() if n in amount and amount[n](q) > 0}
        guaranteed &= limited == {"cpu", "memory"}
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and all(limits.get(name) == value for name, value in requests.items()) and len(requests) == len(limits):
        return "Guaranteed"
    return "Burstable"


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("variant", [{}, {"gpus": 1}, {"launcher": "kserve"}], ids=["cpu", "gpu", "kserve"])
def test_a_replica_is_guaranteed_so_its_workers_can_have_cores_of_their_own(cloud, variant):
    """A worker's requests wait while another process holds its core (bench/RESULTS.md): the
    kubelet's static CPU manager gives a container whole CPUs of its own only in a Guaranteed
    pod with a whole number of CPUs (``pkg/kubelet/cm/cpumanager/policy_static.go``,
    ``guaranteedCPUs``). The /dev/shm volume, which counts against the memory limit, is in
    the memory request too, so the limits equal the requests."""
    pod = the_pod(checked(serve(cloud=cloud, **variant)))
    assert qos_class(pod) == "Guaranteed"
    args, resources = the_server(pod)
    cpus = _millicores(resources["requests"]["cpu"], "test")
    assert cpus % 1000 == 0
    if not variant.get("gpus"):
        assert int(args[args.index("--workers") + 1]) == cpus // 1000  # a core for each worker


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_cpu_replica_runs_a_worker_per_cpu_and_asks_a_cpu_for_each(cloud):
    """One event loop parses every request of its process: a replica of N CPUs runs N worker
    processes (docs/serving.md), and --workers beyond the profile's CPUs asks for one each
    (under a smaller quota the kernel throttles the workers in turn)."""
    cpus = int(load_profile(cloud).serving["requests"]["cpu"])
    args, resources = the_server(the_pod(checked(serve(cloud=cloud))))
    assert args[args.index("--workers") + 1] == str(cpus) and resources["requests"]["cpu"] == str(cpus)
    args, resources = the_server(the_pod(checked(serve(cloud=cloud, train_args=["--workers", str(cpus + 2)]))))
    assert args.count("--workers") == 1 and args[args.index("--workers") + 1] == str(cpus + 2)
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == str(cpus + 2)
    args, resources = the_server(the_pod(checked(serve(cloud=cloud, train_args=["--workers=1"]))))
    assert [a for a in args if a.startswith("--workers")] == ["--workers=1"]
    assert resources["requests"]["cpu"] == str(cpus)  # fewer workers than CPUs: the request is kept
    args, _ = the_server(the_pod(checked(serve(cloud=cloud, gpus=1))))
    assert "--workers" not in args  # one process feeds the GPU; a worker each would copy the tables onto it


def test_a_model_on_the_shared_file_system_mounts_it():
    profile = load_profile("aws")
    path = f"{profile.storage['mount_path']}/models/q"
    pod = the_pod(checked(serve(cloud="aws", model_url=path)))
    assert {"name": "data", "mountPath": profile.storage["mount_path"]} in pod["containers"][0]["volumeMounts"]


def test_admission_refuses_what_keda_and_the_api_server_would():
    docs = serve(cloud="generic", autoscaler="keda")
    scaled = by_kind(docs, "ScaledObject")
    both = [*docs, {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                    "metadata": {"name": "other"},
                    "spec": {"scaleTargetRef": scaled["spec"]["scaleTargetRef"], "maxReplicas": 3}}]  # fmt: skip
    assert "already managed by the hpa 'other'" in str(admission.check(both)[0])
    long = copy.deepcopy(scaled)
    long["metadata"]["name"] = "x" * 60  # fits a name, not KEDA's keda-hpa-<name> label value
    assert "more than a label value's 63" in str(admission.check([long])[0])
    hpa = by_kind(serve(cloud="generic"), "HorizontalPodAutoscaler")
    hpa["spec"]["maxReplicas"] = 1
    hpa["spec"]["minReplicas"] = 2
    assert admission.check([hpa])[0].flag == "max_replicas"


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({}, "model_url"),
        ({"model_url": MODEL, "launcher": "pytorchjob"}, "launcher"),
        ({"model_url": MODEL, "min_replicas": 5, "max_replicas": 2}, "max_replicas"),
        ({"model_url": MODEL, "gpus": -1}, "gpus"),
        ({"model_url": MODEL, "launcher": "kserve", "autoscaler": "keda"}, "autoscaler"),
        ({"model_url": MODEL, "train_args": ["--port", "9000"]}, "--"),
        ({"model_url": MODEL, "train_args": ["--workers", "0"]}, "--"),
        ({"model_url": MODEL, "train_args": ["--workers", "two"]}, "--"),
        ({"model_url": MODEL, "checkpoint_url": "s3://b/c"}, "checkpoint_url"),
    ],
)
def test_bad_serving_options_name_the_flag(kw, flag):
    with pytest.raises(ConfigError) as e:
        render_bundle(DeploySpec(job="serve", **kw))
    assert e.value.flag == flag


def test_a_training_job_takes_no_model_url():
    with pytest.raises(ConfigError) as e:
        DeploySpec(model_url=MODEL, gpus_per_node=0)
    assert e.value.flag == "model_url"


def test_render_job_serve_from_the_command_line(tmp_path, capsys):
    from torchrec_cloud.cli import main

    assert main(["render", "--job", "serve", "--cloud", "azure", "--model_url", "az://models/q", "--output",
                 str(tmp_path), "--", "--max_batch_size", "64"]) == 0  # fmt: skip
    docs = checked(load_documents((tmp_path / "serve.yaml").read_text()))
    assert the_pod(docs)["containers"][0]["args"][-2:] == ["--max_batch_size", "64"]
    capsys.readouterr()
    assert main(["render", "--job", "serve", "--cloud", "azure"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model_url" in err


def test_submit_job_serve_applies_the_bundle(cli, tmp_path):
    """`submit --job serve`: --dry-run prints the bundle; a real submission checks the
    cluster's version and hands the bundle to kubectl apply (a stand-in kubectl here); a
    model read from a bucket needs no storage claim; managed targets are refused."""
    flags = ["submit", "--target", "kubernetes", "--job", "serve", "--cloud", "aws", "--model_url", MODEL]
    done = cli(*flags, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert [d["kind"] for d in load_documents(done.stdout)] == KINDS["hpa"]
    assert "kubectl apply -f -" in done.stderr and "-l torchrec-cloud/job=torchrec-serve" in done.stderr
    real = [*flags, "--image", "444455556666.dkr.ecr.us-west-2.amazonaws.com/torchrec-cloud:0.1.0",
            "--identity", "arn:aws:iam::444455556666:role/serve"]  # fmt: skip
    kubectl = fake_kubectl(tmp_path, "1.29")
    done = cli(*real, "--kubectl", str(kubectl))
    assert done.returncode == 1 and not (tmp_path / "applied.yaml").exists()
    assert "older than the 1.30" in done.stderr
    fake_kubectl(tmp_path, "1.31")
    done = cli(*real, "--kubectl", str(kubectl))
    assert done.returncode == 0, done.stderr
    applied = load_documents((tmp_path / "applied.yaml").read_text())
    assert [d["kind"] for d in applied] == KINDS["hpa"] and "torchrec-serve.torchrec.svc:8080" in done.stdout
    done = cli("submit", "--target", "vertex", "--job", "serve", "--cloud", "gcp", "--model_url", MODEL, "--dry-run")
    assert done.returncode == 2 and "--target kubernetes" in done.stderr
