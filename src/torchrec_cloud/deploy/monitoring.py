"""What each cloud's managed Prometheus collector needs to scrape every rank of a job: data in
``monitoring_profiles.yaml.j2``, rendered for one job by :func:`monitoring_profile`.

The manifests (:mod:`torchrec_cloud.deploy.manifests`) add its pod labels, annotations,
container ports and trainer flags to the training pods, and its objects (PodMonitoring,
PodMonitor, CloudWatch agent ConfigMaps) to the bundle; the profile's ``monitoring`` key
names the entry::

    mp = monitoring_profile("gcp", job_name="dlrm", port=29600, nproc_per_node=8)
    mp.pod_labels, mp.container_args, mp.manifests
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrec_cloud.config import ConfigError

MONITORING_PROFILES = Path(__file__).with_name("monitoring_profiles.yaml.j2")


@dataclass
class MonitoringProfile:
    """The pieces a rendered job needs so that one cloud's collector scrapes every rank.

    ``pod_labels``, ``pod_annotations``, ``container_ports`` and ``container_args`` go into
    the training pod template; ``manifests`` are extra Kubernetes objects to apply, with
    ``note`` saying what applying them does beyond the job (or why they were left out), and
    ``setup`` what the cluster needs first.
    """

    cloud: str
    collector: str
    docs: str
    pod_labels: dict[str, str]
    pod_annotations: dict[str, str]
    container_ports: list[dict[str, Any]]
    container_args: list[str]
    manifests: list[dict[str, Any]]
    note: str = ""
    setup: str = ""
    scraped_from: list[dict[str, Any]] = field(default_factory=list)
    """NetworkPolicy peers (namespaceSelector/podSelector) of the collector's scraping pods:
    the job's NetworkPolicy admits them, and only them, to the metrics ports."""


def _duration_seconds(text: str) -> int:
    """Seconds in a simple Prometheus duration ("30s", "1m", "500ms"); ValueError otherwise."""
    import re

    m = re.fullmatch(r"(\d+)(ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(f"scrape interval must look like 30s, 1m or 500ms, got {text!r}")
    value, unit = int(m.group(1)), m.group(2)
    return math.ceil(value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit])


def monitoring_clouds() -> list[str]:
    """Clouds with a profile in monitoring_profiles.yaml.j2."""
    return sorted(_render_profiles("job", "default", 29600, 1, "30s")["clouds"])


def _render_profiles(job_name: str, namespace: str, port: int, nproc_per_node: int,
                     scrape_interval: str) -> dict[str, Any]:
    import jinja2
    import yaml

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = env.from_string(MONITORING_PROFILES.read_text(encoding="utf-8")).render(
        job_name=job_name,
        namespace=namespace,
        port=port,
        ranks=list(range(nproc_per_node)),
        scrape_interval=scrape_interval,
        # Long enough for one more scrape after the run's final evaluation.
        linger_s=_duration_seconds(scrape_interval) + 5,
    )
    return yaml.safe_load(text)


def monitoring_profile(
    cloud: str,
    *,
    job_name: str,
    port: int,
    namespace: str = "default",
    nproc_per_node: int = 1,
    scrape_interval: str = "30s",
    cluster_wide: bool = True,
) -> MonitoringProfile:
    """Render the scrape set-up of ``cloud`` for a job whose pods run ``nproc_per_node`` ranks
    serving on ``port`` .. ``port + nproc_per_node - 1`` (the deployment's --prometheus_port).

    A collector configured for the whole cluster (an entry marked ``cluster_wide``) gets its
    objects only with ``cluster_wide=True``: applying them replaces what is there.
    """
    if not 1 <= port or port + nproc_per_node - 1 > 65535:
        raise ConfigError(
            "prometheus_port",
            f"ports {port}..{port + nproc_per_node - 1} (one per local rank) must lie in 1..65535",
        )
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    data = _render_profiles(job_name, namespace, port, nproc_per_node, scrape_interval)
    clouds = data["clouds"]
    if cloud not in clouds:
        raise ValueError(f"no monitoring profile for cloud {cloud!r}; known: {', '.join(sorted(clouds))}")
    common, entry = data["common"], clouds[cloud]
    manifests, note = list(entry["manifests"]), str(entry.get("note", ""))
    if entry.get("cluster_wide") and not cluster_wide:
        manifests = []
        note = (f"{entry['collector']} reads its scrape jobs from a configuration that serves the "
                "whole cluster; it is not part of this bundle (render with --cluster_monitoring to "
                "add it, or merge the torchrec-cloud job into your own copy). The pods carry the "
                "labels, ports and prometheus.io/* annotations it needs.")
    return MonitoringProfile(
        cloud=cloud,
        collector=entry["collector"],
        docs=entry["docs"],
        pod_labels=dict(common["pod"]["labels"]),
        pod_annotations=dict(common["pod"]["annotations"]),
        container_ports=list(common["container"]["ports"]),
        container_args=[str(a) for a in common["container"]["args"]],
        manifests=manifests,
        note=note,
        setup=str(entry.get("setup", "")),
        scraped_from=list(entry.get("scraped_from") or []),
    )
