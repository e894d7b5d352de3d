"""Live metrics of a run for Prometheus, and the sinks every rank logs to.

The trainer builds its sinks once per process::

    sink = build_sinks(cfg, rank=rank, local_rank=local_rank, world_size=world_size)
    sink.log({"event": "train", "step": 10, "loss": 0.69, "samples_per_s": 12000.0, ...})
    sink.close()

Rank 0 writes ``metrics.jsonl``, TensorBoard events and console lines (see
:mod:`torchrec_cloud.metrics`). With ``--prometheus_port PORT`` *every* rank also serves
``http://<metrics_host>:<PORT + local rank>/metrics``, which the clusters' managed
collectors scrape (Google Managed Prometheus, Azure Monitor managed Prometheus, the
CloudWatch agent; what each needs is data in ``monitoring_profiles.yaml.j2``, rendered by
:func:`monitoring_profile` for the deployment manifests)::

    torchrec-cloud train --preset quickstart --prometheus_port 29600
    curl -s localhost:29600/metrics | grep ^torchrec_

Exported series (all carry a ``rank`` label; ``docs/observability.md`` has the full table):

* from train records: ``torchrec_train_step``, ``torchrec_train_samples_per_second``,
  ``torchrec_train_loss``, ``torchrec_learning_rate``, ``torchrec_world_size`` and
  ``torchrec_train_step_phase_seconds{phase=...}`` from the step-time keys in
  :data:`STEP_PHASE_KEYS`;
* from eval records: ``torchrec_eval_auc``, ``torchrec_eval_logloss``, ``torchrec_eval_ne``,
  ``torchrec_eval_step`` with a ``split`` label (``val``/``test``);
* from checkpoint and resume records: ``torchrec_checkpoint_{save,load}_{seconds,bytes}``,
  ``torchrec_checkpoint_saves_total``, ``torchrec_checkpoint_last_step``;
* sampled by a background thread every ``--system_metrics_interval`` seconds: host CPU,
  memory, network bytes and the container's cgroup memory; and, when NVML sees a GPU, the
  local rank's GPU utilisation, memory and power (``torchrec_gpu_*``);
* the client library's own ``process_*`` series (CPU seconds, resident memory, open fds).

``prometheus-client`` and ``nvidia-ml-py`` are imported only when the endpoint is built.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    MultiSink,
    NullSink,
    TensorBoardSink,
)

if TYPE_CHECKING:
    from torchrec_cloud.config import JobConfig

log = logging.getLogger(__name__)

METRIC_PREFIX = "torchrec_"

# Step-time keys of a train record (seconds per step, averaged over the logging window)
# and the ``phase`` label each one becomes. The trainer logs what it can measure.
STEP_PHASE_KEYS: dict[str, str] = {
    "data_wait_s": "data_wait",
    "fwd_bwd_opt_s": "fwd_bwd_opt",
    "pipeline_wait_s": "pipeline_wait",
    "step_s": "total",
}


def _number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (not a bool, not NaN), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value else None


# ---------------------------------------------------------------------------------------
# System gauges: sampled in a background thread, read at scrape time.


def _nvml_device_index(local_rank: int, device_count: int) -> tuple[str, Optional[int]]:
    """Which NVML device is this local rank's: ``("uuid", None)`` or ``("", index)``.

    Ranks use ``cuda:<local_rank>`` among the visible devices. Inside a Kubernetes pod NVML
    sees only the pod's GPUs, so the index is the local rank; with CUDA_VISIBLE_DEVICES
    set, NVML still enumerates every GPU, so the visible list is mapped back.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if entries:
            entry = entries[local_rank % len(entries)]
            if entry.startswith("GPU-"):
                return entry, None
            if entry.isdigit():
                return "", int(entry)
    return "", local_rank % device_count


class SystemMetricsCollector:
    """Samples host (psutil) and GPU (NVML) figures every ``interval`` seconds.

    A prometheus-client custom collector: :meth:`collect` turns the latest sample into
    metric families at scrape time, so a scrape never waits on NVML or /proc.
    """

    def __init__(self, rank: int, local_rank: int, interval: float) -> None:
        import psutil

        self._psutil = psutil
        self._rank = str(rank)
        self._local_rank = local_rank
        self._interval = interval
        self._lock = threading.Lock()
        self._sample: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._nvml = None
        self._gpu_handle = None
        self._gpu_label = ""
        self._open_nvml()
        psutil.cpu_percent(interval=None)  # the first call only sets the reference point

    def _open_nvml(self) -> None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return  # no driver: a CPU machine
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                pynvml.nvmlShutdown()
                return
            uuid, index = _nvml_device_index(self._local_rank, count)
            if uuid:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._gpu_label = str(pynvml.nvmlDeviceGetIndex(handle))
        except pynvml.NVMLError as e:
            log.warning("NVML sees a GPU but cannot open local rank %d's: %s", self._local_rank, e)
            pynvml.nvmlShutdown()
            return
        self._nvml, self._gpu_handle = pynvml, handle

    @property
    def has_gpu(self) -> bool:
        return self._gpu_handle is not None

    def sample(self) -> dict[str, Any]:
        """Take one sample now (also what the background thread does) and return it."""
        ps = self._psutil
        vm = ps.virtual_memory()
        net = ps.net_io_counters()
        s: dict[str, Any] = {
            "host_cpu_utilization_ratio": ps.cpu_percent(interval=None) / 100.0,
            "host_memory_used_bytes": float(vm.total - vm.available),
            "host_memory_total_bytes": float(vm.total),
            "host_network_receive_bytes_total": float(net.bytes_recv) if net else 0.0,
            "host_network_transmit_bytes_total": float(net.bytes_sent) if net else 0.0,
        }
        s.update(_cgroup_memory())
        if self._gpu_handle is not None:
            s.update(self._gpu_sample())
        with self._lock:
            self._sample = s
        return s

    def _gpu_sample(self) -> dict[str, float]:
        nvml, h = self._nvml, self._gpu_handle
        out: dict[str, float] = {}
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            out["gpu_utilization_ratio"] = util.gpu / 100.0
            out["gpu_memory_utilization_ratio"] = util.memory / 100.0
            out["gpu_memory_used_bytes"] = float(mem.used)
            out["gpu_memory_total_bytes"] = float(mem.total)
        except nvml.NVMLError as e:
            log.debug("NVML utilisation/memory query failed: %s", e)
        try:
            out["gpu_power_watts"] = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        except nvml.NVMLError:
            pass  # not every board reports power
        return out

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="torchrec-system-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sample()
            except Exception as e:  # a failed sample must never stop training
                log.debug("system metrics sample failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = self._gpu_handle = None

    def describe(self):
        return []  # the families depend on the machine; nothing to check at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            sample = dict(self._sample)
        for key, value in sorted(sample.items()):
            name = METRIC_PREFIX + key
            doc = _SYSTEM_HELP.get(key, key.replace("_", " "))
            if key.startswith("gpu_"):
                labels, values = ["rank", "gpu"], [self._rank, self._gpu_label]
            else:
                labels, values = ["rank"], [self._rank]
            if key.endswith("_total"):
                family = CounterMetricFamily(name[: -len("_total")], doc, labels=labels)
            else:
                family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family


_SYSTEM_HELP = {
    "host_cpu_utilization_ratio": "Busy fraction of all host CPUs since the previous sample.",
    "host_memory_used_bytes": "Host memory in use (total minus available).",
    "host_memory_total_bytes": "Host memory installed.",
    "host_network_receive_bytes_total": "Bytes received on all host network interfaces.",
    "host_network_transmit_bytes_total": "Bytes sent on all host network interfaces.",
    "container_memory_used_bytes": "Memory charged to this container's cgroup.",
    "container_memory_limit_bytes": "Memory limit of this container's cgroup.",
    "gpu_utilization_ratio": "Fraction of the last sample period a kernel ran on this rank's GPU.",
    "gpu_memory_utilization_ratio": "Fraction of the last sample period GPU memory was read or written.",
    "gpu_memory_used_bytes": "GPU memory allocated on this rank's GPU (all processes).",
    "gpu_memory_total_bytes": "GPU memory installed on this rank's GPU.",
    "gpu_power_watts": "Power drawn by this rank's GPU.",
}


def _cgroup_memory() -> dict[str, float]:
    """The container's memory use and limit, which is what the OOM killer goes by."""
    out: dict[str, float] = {}
    # cgroup v2 (most current nodes), then v1 (e.g. Amazon Linux 2 EKS nodes).
    for used_file, limit_file in (
        ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.max"),
        ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ):
        try:
            out["container_memory_used_bytes"] = float(Path(used_file).read_text())
            limit = Path(limit_file).read_text().strip()
        except (OSError, ValueError):
            continue
        # "max" (v2) or a near-2^63 number (v1) mean no limit.
        if limit != "max" and float(limit) < 2**60:
            out["container_memory_limit_bytes"] = float(limit)
        break
    return out


# ---------------------------------------------------------------------------------------
# The Prometheus sink.


class PrometheusSink(MetricsSink):
    """Serves the latest training figures of one rank on ``http://host:port/metrics``.

    Each sink owns its registry, so several can live in one process (tests, tools).
    :meth:`close` stops the HTTP server and the sampling thread.
    """

    def __init__(
        self,
        port: int,
        *,
        host: str = "0.0.0.0",
        rank: int = 0,
        local_rank: int = 0,
        system_metrics_interval: float = 5.0,
        linger: float = 0.0,
    ) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
            from prometheus_client import start_http_server
        except ImportError as e:
            raise ConfigError(
                "prometheus_port",
                "needs the prometheus-client package: pip install prometheus-client",
            ) from e

        self.port = port
        self.host = host
        self.rank = rank
        self.linger = linger
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        ProcessCollector(registry=reg)

        def gauge(name: str, doc: str, *labels: str):
            return Gauge(METRIC_PREFIX + name, doc, ["rank", *labels], registry=reg)

        # Series appear on their first value: a 0 before the first record would read as data.
        self._train = {
            "step": gauge("train_step", "Last training step logged."),
            "samples_per_s": gauge(
                "train_samples_per_second",
                "Job throughput over the last logging window (samples/s), as timed by this rank.",
            ),
            "loss": gauge("train_loss", "Training loss (mean over the logging window)."),
            "lr": gauge("learning_rate", "Learning rate of the dense optimizer."),
            "world_size": gauge("world_size", "Ranks in the job."),
        }
        self._phase = gauge(
            "train_step_phase_seconds",
            "Seconds per step spent in each phase (data_wait, fwd_bwd_opt, pipeline_wait, total).",
            "phase",
        )
        self._eval = {
            "auc": gauge("eval_auc", "ROC AUC of the last evaluation.", "split"),
            "logloss": gauge("eval_logloss", "Log loss of the last evaluation.", "split"),
            "ne": gauge("eval_ne", "Normalized entropy of the last evaluation.", "split"),
            "step": gauge("eval_step", "Training step of the last evaluation.", "split"),
        }
        self._bayes_auc = gauge("data_bayes_auc", "Best AUC reachable on planted synthetic data.")
        self._ckpt_save_s = gauge("checkpoint_save_seconds", "Duration of the last checkpoint save.")
        self._ckpt_save_b = gauge("checkpoint_save_bytes", "Size of the last checkpoint saved.")
        self._ckpt_load_s = gauge("checkpoint_load_seconds", "Duration of the last checkpoint load.")
        self._ckpt_load_b = gauge("checkpoint_load_bytes", "Size of the last checkpoint loaded.")
        self._ckpt_step = gauge("checkpoint_last_step", "Step of the last checkpoint saved.")
        self._ckpt_saves = Counter(
            METRIC_PREFIX + "checkpoint_saves", "Checkpoints saved by this process.", ["rank"], registry=reg
        )
        self._start_time = gauge("run_start_time_seconds", "Unix time the run started.")
        self._end_time = gauge("run_end_time_seconds", "Unix time the run ended.")

        self._system = SystemMetricsCollector(rank, local_rank, system_metrics_interval)
        reg.register(self._system)
        try:
            self._server, self._server_thread = start_http_server(port, addr=host, registry=reg)
        except OSError as e:
            self._system.stop()
            raise ConfigError(
                "prometheus_port",
                f"rank {rank} cannot serve metrics on {host}:{port} ({e.strerror or e}); "
                "choose a free port (local rank r uses --prometheus_port + r)",
            ) from e
        self._system.start()

    @property
    def has_gpu(self) -> bool:
        return self._system.has_gpu

    def log(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "train":
            self._log_train(record)
        elif event == "eval":
            split = str(record.get("split") or "val")
            for key, g in self._eval.items():
                value = _number(record.get(key))
                if value is not None:
                    g.labels(str(self.rank), split).set(value)
        elif event == "checkpoint":
            self._set(self._ckpt_save_s, record.get("seconds"))
            self._set(self._ckpt_save_b, record.get("bytes"))
            self._set(self._ckpt_step, record.get("step"))
            self._ckpt_saves.labels(str(self.rank)).inc()
        elif event == "resume":
            self._set(self._ckpt_load_s, record.get("seconds"))
            self._set(self._ckpt_load_b, record.get("bytes"))
        elif event == "start":
            # The trainer's records carry no time stamp (JsonlSink adds its own).
            self._set(self._start_time, record.get("time", time.time()))
            self._set(self._train["world_size"], record.get("world_size"))
            self._set(self._bayes_auc, record.get("bayes_auc"))
        elif event == "end":
            self._set(self._end_time, record.get("time", time.time()))

    def _log_train(self, record: dict[str, Any]) -> None:
        for key, g in self._train.items():
            self._set(g, record.get(key))
        for key, phase in STEP_PHASE_KEYS.items():
            value = _number(record.get(key))
            if value is not None:
                self._phase.labels(str(self.rank), phase).set(value)

    def _set(self, gauge, value: Any) -> None:
        value = _number(value)
        if value is not None:
            gauge.labels(str(self.rank)).set(value)

    def close(self) -> None:
        if self.linger > 0:
            # A batch job's last values (the test evaluation) would otherwise end with the
            # process, before the collector's next scrape.
            time.sleep(self.linger)
        self._system.stop()
        self._server.shutdown()
        self._server.server_close()


# ---------------------------------------------------------------------------------------
# The sinks of one process.


def build_sinks(
    cfg: "JobConfig",
    rank: int,
    local_rank: int,
    world_size: int,
    console_write: Callable[[str], None] = print,
) -> MetricsSink:
    """The sinks one rank logs to.

    Rank 0: ``metrics.jsonl`` + TensorBoard (unless ``--no-tensorboard``) + console lines
    (``console_write``, e.g. ``tqdm.write`` beside a progress bar). Every rank, with
    ``--prometheus_port``: a :class:`PrometheusSink` on port + ``local_rank``.
    """
    out = cfg.output
    sinks: list[MetricsSink] = []
    if rank == 0:
        sinks.append(JsonlSink(Path(out.output_dir) / "metrics.jsonl"))
        if out.tensorboard:
            sinks.append(TensorBoardSink(out.output_dir))
        sinks.append(ConsoleSink(console_write))
    if out.prometheus_port is not None:
        port = out.prometheus_port + local_rank
        if port > 65535:
            raise ConfigError(
                "prometheus_port",
                f"local rank {local_rank} would serve on port {port}, past 65535; "
                "choose a lower port",
            )
        try:
            sinks.append(
                PrometheusSink(
                    port,
                    host=out.metrics_host,
                    rank=rank,
                    local_rank=local_rank,
                    system_metrics_interval=out.system_metrics_interval,
                    linger=out.prometheus_linger,
                )
            )
        except Exception:
            for sink in sinks:
                sink.close()
            raise
    if not sinks:
        return NullSink()
    return sinks[0] if len(sinks) == 1 else MultiSink(sinks)


# ---------------------------------------------------------------------------------------
# What each cloud's managed collector needs to scrape the ranks (data for the deployment).

MONITORING_PROFILES = Path(__file__).with_name("monitoring_profiles.yaml.j2")


@dataclass
class MonitoringProfile:
    """The pieces a rendered job needs so that one cloud's collector scrapes every rank.

    ``pod_labels``, ``pod_annotations``, ``container_ports`` and ``container_args`` go into
    the training pod template; ``manifests`` are extra Kubernetes objects to apply, with
    ``note`` saying what applying them does beyond the job, if anything, and ``setup`` what
    the cluster needs first. ``needs_declared_ports``: the collector finds ranks only through
    declared container ports (``ports_declared=False`` then scrapes nothing).
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
    needs_declared_ports: bool = False


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
    return sorted(_render_profiles("job", "default", 29600, 1, "30s", True)["clouds"])


def _render_profiles(job_name: str, namespace: str, port: int, nproc_per_node: int,
                     scrape_interval: str, ports_declared: bool) -> dict[str, Any]:
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
        ports_declared=ports_declared,
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
    ports_declared: bool = True,
    cluster_wide: bool = True,
) -> MonitoringProfile:
    """Render the scrape set-up of ``cloud`` for a job whose pods run ``nproc_per_node`` ranks
    serving on ``port`` .. ``port + nproc_per_node - 1`` (the deployment's --prometheus_port).

    ``ports_declared=False`` is for pod templates that cannot carry ``container_ports``
    (a Kubeflow TrainJob): collectors that accept port numbers are given numbers instead.
    """
    if not 1 <= port or port + nproc_per_node - 1 > 65535:
        raise ConfigError(
            "prometheus_port",
            f"ports {port}..{port + nproc_per_node - 1} (one per local rank) must lie in 1..65535",
        )
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    data = _render_profiles(job_name, namespace, port, nproc_per_node, scrape_interval, ports_declared)
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
    if entry.get("needs_declared_ports") and not ports_declared:
        manifests = []
        note = (f"{entry['collector']} finds the ranks through declared container ports, which "
                "this pod template cannot declare, so it scrapes nothing here; the prometheus.io/* "
                "annotations (local rank 0, for scrapers that read them) remain. A launcher whose "
                "pods declare ports (Indexed Job, PyTorchJob) gets every rank's metrics.")
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
        needs_declared_ports=bool(entry.get("needs_declared_ports", False)),
    )
