"""Per-cloud scrape set-up (monitoring_profiles.yaml.j2) agrees with what the ranks serve.

The AWS scrape job is checked by Prometheus's own promtool; the CloudWatch metric
declarations are checked against the series a live endpoint exports, so a new metric
that no declaration maps (or maps with a dimension it lacks) fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from observed_run import PrometheusServer, free_port, prometheus_binary

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.monitoring import monitoring_clouds, monitoring_profile
from torchrec_cloud.metrics.prometheus import PrometheusSink

# Kubernetes IANA_SVC_NAME: what a named container port may be called.
PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")


def test_three_clouds_and_any_cluster_have_profiles() -> None:
    assert monitoring_clouds() == ["aws", "azure", "gcp", "generic"]
    # Any cluster: the conventional annotations and ports, no collector objects to apply.
    p = monitoring_profile("generic", job_name="j", port=29600, nproc_per_node=2)
    assert p.manifests == [] and p.pod_annotations["prometheus.io/scrape"] == "true"
    assert [c["containerPort"] for c in p.container_ports] == [29600, 29601]


def test_cluster_wide_collector_configuration_only_on_request() -> None:
    """The CloudWatch agent's ConfigMaps configure it for every job of the cluster."""
    p = monitoring_profile("aws", job_name="j", port=29600, nproc_per_node=2, cluster_wide=False)
    assert p.manifests == [] and "--cluster_monitoring" in p.note
    assert [c["containerPort"] for c in p.container_ports] == [29600, 29601]  # the pods still say where
    assert [m["kind"] for m in monitoring_profile("aws", job_name="j", port=29600).manifests] == ["ConfigMap"] * 2
    # Namespaced collectors' objects are the job's own: always rendered.
    assert monitoring_profile("gcp", job_name="j", port=29600, cluster_wide=False).manifests


@pytest.mark.parametrize("cloud", ["aws", "azure", "gcp"])
@pytest.mark.parametrize("nproc", [1, 8])
def test_every_local_rank_gets_a_scraped_port(cloud: str, nproc: int) -> None:
    p = monitoring_profile(cloud, job_name="dlrm-a", namespace="ml", port=9400, nproc_per_node=nproc)
    assert [c["containerPort"] for c in p.container_ports] == list(range(9400, 9400 + nproc))
    names = [c["name"] for c in p.container_ports]
    assert len(set(names)) == nproc and all(PORT_NAME.match(n) for n in names), names
    # The endpoint outlives the run by more than one scrape interval (30s by default), and is
    # reachable by the collector (the trainer binds 127.0.0.1 unless told otherwise).
    assert p.container_args == ["--metrics_host", "0.0.0.0", "--prometheus_port", "9400", "--prometheus_linger", "35"]
    assert p.pod_annotations["prometheus.io/port"] == "9400"
    for m in p.manifests:
        assert m["apiVersion"] and m["kind"] and m["metadata"]["name"] and m["metadata"]["namespace"]
    if cloud in ("gcp", "azure"):
        (monitor,) = p.manifests
        assert monitor["metadata"]["namespace"] == "ml"
        # The monitor selects exactly the job's pods, by a label the pod template carries.
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= p.pod_labels.items()
        endpoints = monitor["spec"]["endpoints" if cloud == "gcp" else "podMetricsEndpoints"]
        assert [e["port"] for e in endpoints] == names
        assert all(e["path"] == "/metrics" for e in endpoints)


def _aws_configs(nproc: int = 2) -> tuple[str, dict]:
    p = monitoring_profile("aws", job_name="dlrm-a", port=9400, namespace="ml", nproc_per_node=nproc)
    maps = {m["metadata"]["name"]: m["data"] for m in p.manifests}
    return maps["prometheus-config"]["prometheus.yaml"], json.loads(maps["prometheus-cwagentconfig"]["cwagentconfig.json"])


def test_aws_scrape_job_keeps_every_rank_and_nothing_else(tmp_path: Path) -> None:
    """Run the CloudWatch agent's scrape job in a real Prometheus.

    The Debian build of Prometheus has no Kubernetes discovery, so the pods that
    ``kubernetes_sd_configs`` would find are handed over by file discovery with the same
    ``__meta_kubernetes_*`` labels; everything else in the job runs as written.
    """
    binary = prometheus_binary()
    scrape_yaml, _ = _aws_configs()
    config = yaml.safe_load(scrape_yaml)
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["ml"]}}]

    port0, port1, decoy = free_port(), free_port(), free_port()
    sinks = [PrometheusSink(p, host="127.0.0.1", rank=r, system_metrics_interval=60)
             for r, p in ((0, port0), (1, port1), (9, decoy))]
    pod = {"__meta_kubernetes_namespace": "ml", "__meta_kubernetes_pod_name": "dlrm-a-worker-0",
           "__meta_kubernetes_pod_label_torchrec_cloud_metrics": "true",
           "__meta_kubernetes_pod_label_torchrec_cloud_job": "dlrm-a"}
    targets = [
        {"targets": [f"127.0.0.1:{port0}"], "labels": {**pod, "__meta_kubernetes_pod_container_port_name": "metrics-0"}},
        {"targets": [f"127.0.0.1:{port1}"], "labels": {**pod, "__meta_kubernetes_pod_container_port_name": "metrics-1"}},
        # Another port of the same pod (say a debug server) is not a metrics port.
        {"targets": [f"127.0.0.1:{decoy}"], "labels": {**pod, "__meta_kubernetes_pod_container_port_name": "http"}},
        # A pod that did not opt in.
        {"targets": [f"127.0.0.1:{decoy}"], "labels": {**pod, "__meta_kubernetes_pod_label_torchrec_cloud_metrics": "false",
                                                        "__meta_kubernetes_pod_container_port_name": "metrics-0"}},
    ]
    (tmp_path / "pods.json").write_text(json.dumps(targets))
    del job["kubernetes_sd_configs"]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "pods.json")], "refresh_interval": "1s"}]
    config["global"].update(scrape_interval="1s", scrape_timeout="900ms")

    promtool = binary.parent / "promtool"
    (tmp_path / "check.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([str(promtool), "check", "config", str(tmp_path / "check.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    try:
        for sink in sinks:
            sink.log({"event": "train", "step": 3, "loss": 0.5, "samples_per_s": 100.0})
        with PrometheusServer(binary, tmp_path / "prom", yaml.safe_dump(config)) as server:
            deadline = time.time() + 30
            while True:
                result = server.api("query", query="torchrec_train_step")["result"]
                if len(result) >= 2 or time.time() > deadline:
                    break
                time.sleep(0.5)
            targets_now = server.api("targets")
    finally:
        for sink in sinks:
            sink.close()
    scraped = sorted((r["metric"]["rank"], r["metric"]["torchrec_job"], r["metric"]["Namespace"],
                      r["metric"]["pod_name"]) for r in result)
    assert scraped == [("0", "dlrm-a", "ml", "dlrm-a-worker-0"), ("1", "dlrm-a", "ml", "dlrm-a-worker-0")]
    assert len(targets_now["activeTargets"]) == 2
    assert len(targets_now["droppedTargets"]) == 2


def test_cloudwatch_declarations_cover_every_exported_metric() -> None:
    _, cw = _aws_configs()
    declarations = cw["logs"]["metrics_collected"]["prometheus"]["emf_processor"]["metric_declaration"]
    added_by_scrape = {"ClusterName", "Namespace", "torchrec_job"}  # agent + relabel rules

    port = free_port()
    sink = PrometheusSink(port, host="127.0.0.1", rank=0, system_metrics_interval=60)
    try:
        sink.log({"event": "start", "time": 1.0, "world_size": 1, "bayes_auc": 0.8})
        sink.log({"event": "train", "step": 1, "loss": 0.7, "samples_per_s": 1.0, "lr": 0.1,
                  "world_size": 1, "data_wait_s": 0.1, "step_s": 0.2})
        sink.log({"event": "eval", "split": "val", "step": 1, "auc": 0.6, "logloss": 0.6, "ne": 1.0})
        sink.log({"event": "checkpoint", "step": 1, "seconds": 1.0, "bytes": 10})
        sink.log({"event": "resume", "step": 1, "seconds": 1.0, "bytes": 10})
        sink.log({"event": "end", "time": 2.0})
        from prometheus_client.parser import text_string_to_metric_families
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()

    exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("torchrec_") and not sample.name.endswith("_created"):
                exported[sample.name] = set(sample.labels)
    assert len(exported) > 15
    for name, labels in exported.items():
        fitting = [
            d for d in declarations
            if any(re.search(sel, name) for sel in d["metric_selectors"])
            and any(set(dims) - added_by_scrape <= labels for dims in d["dimensions"])
        ]
        assert fitting, f"{name} (labels {sorted(labels)}) reaches CloudWatch through no declaration"
    # GPU series only exist on GPU machines; their declaration must carry the gpu label.
    gpu = [d for d in declarations if any(re.search(s, "torchrec_gpu_utilization_ratio") for s in d["metric_selectors"])]
    assert gpu and all("gpu" in dims for d in gpu for dims in d["dimensions"])


def test_ports_past_65535_are_rejected() -> None:
    with pytest.raises(ConfigError) as e:
        monitoring_profile("gcp", job_name="j", port=65530, nproc_per_node=8)
    assert e.value.flag == "prometheus_port"


def test_unknown_cloud_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="aws, azure, gcp"):
        monitoring_profile("oracle", job_name="j", port=9400)
