"""Host and GPU gauges of one rank, sampled in a background thread and read at scrape time.

Part of the Prometheus endpoint (:mod:`torchrec_cloud.metrics.prometheus`): host CPU, memory,
network bytes and the container's cgroup memory from psutil and /sys; when NVML sees a GPU,
the local rank's utilisation, memory and power. ``nvidia-ml-py`` is imported only here.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

METRIC_PREFIX = "torchrec_"


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
