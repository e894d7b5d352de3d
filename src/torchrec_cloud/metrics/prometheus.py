"""Live metrics of a run for Prometheus: one endpoint per rank.

With ``--prometheus_port PORT`` *every* rank serves
``http://<metrics_host>:<PORT + local rank>/metrics`` (:class:`PrometheusSink`, built by
:func:`torchrec_cloud.metrics.build_sinks`), which the clusters' managed collectors scrape
(Google Managed Prometheus, Azure Monitor managed Prometheus, the CloudWatch agent; what
each needs is data in ``deploy/monitoring_profiles.yaml.j2``, rendered by
:mod:`torchrec_cloud.deploy.monitoring` for the deployment manifests)::

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
* sampled by a background thread every ``--system_metrics_interval`` seconds
  (:mod:`torchrec_cloud.metrics.system`): host CPU,
  memory, network bytes and the container's cgroup memory; and, when NVML sees a GPU, the
  local rank's GPU utilisation, memory and power (``torchrec_gpu_*``);
* the client library's own ``process_*`` series (CPU seconds, resident memory, open fds).

``prometheus-client`` and ``nvidia-ml-py`` are imported only when the endpoint is built.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.metrics.sinks import MetricsSink
from torchrec_cloud.metrics.system import METRIC_PREFIX, SystemMetricsCollector

# Step-time keys of a train record (seconds per step, averaged over the logging window)
# and the ``phase`` label each one becomes. The trainer logs what it can measure.
STEP_PHASE_KEYS: dict[str, str] = {
    "data_wait_s": "data_wait",
    "fwd_bwd_opt_s": "fwd_bwd_opt",
    "step_s": "total",
}


def _number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (not a bool, not NaN), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value == value else None


class PrometheusSink(MetricsSink):
    """Serves the latest training figures of one rank on ``http://host:port/metrics``.

    Each sink owns its registry, so several can live in one process (tests, tools).
    :meth:`close` stops the HTTP server and the sampling thread.
    """

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
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
            "Seconds per step spent in each phase (data_wait, fwd_bwd_opt, total).",
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
