"""Where a run's numbers go: one small interface, one class per sink, and the sinks of a rank.

The training loop calls :meth:`MetricsSink.log` with flat records (``event``, ``step``,
``split``, ``loss``, ``auc``, ``logloss``, ``samples_per_s``, ``world_size``, ...). The
trainer builds its sinks once per process::

    sink = build_sinks(cfg, rank=rank, local_rank=local_rank, world_size=world_size)
    sink.log({"event": "train", "step": 10, "loss": 0.69, "samples_per_s": 12000.0, ...})
    sink.close()

Rank 0 writes ``metrics.jsonl``, TensorBoard events and console lines (:mod:`.sinks`); with
``--prometheus_port`` every rank also serves its metrics (:mod:`.prometheus`, with host and
GPU gauges from :mod:`.system`). Optional backends are imported only when their sink is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from torchrec_cloud.config import ConfigError
from torchrec_cloud.metrics.sinks import (
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    MultiSink,
    NullSink,
    TensorBoardSink,
)

if TYPE_CHECKING:
    from torchrec_cloud.config import JobConfig

__all__ = ["ConsoleSink", "JsonlSink", "MetricsSink", "MultiSink", "NullSink", "TensorBoardSink", "build_sinks"]


def build_sinks(
    cfg: "JobConfig",
    rank: int,
    local_rank: int,
    world_size: int,
    console_write: Callable[[str], None] = print,
    train_lines: bool = True,
) -> MetricsSink:
    """The sinks one rank logs to.

    Rank 0: ``metrics.jsonl`` + TensorBoard (unless ``--no-tensorboard``) in ``--output_dir``
    (the run folder: :mod:`.run_folder`), and console lines (``console_write``, e.g.
    ``tqdm.write`` beside a progress bar; a line per train record unless ``train_lines`` is
    off, when the bar shows them). Every rank, with ``--prometheus_port``: a
    :class:`PrometheusSink` on port + ``local_rank``.
    """
    out = cfg.output
    sinks: list[MetricsSink] = []
    if rank == 0:
        sinks.append(JsonlSink(Path(out.output_dir) / "metrics.jsonl"))
        if out.tensorboard:
            sinks.append(TensorBoardSink(out.output_dir))
        sinks.append(ConsoleSink(console_write, train_lines, out.output_dir, out.tensorboard))
    if out.prometheus_port is not None:
        port = out.prometheus_port + local_rank
        if port > 65535:
            raise ConfigError(
                "prometheus_port",
                f"local rank {local_rank} would serve on port {port}, past 65535; "
                "choose a lower port",
            )
        from torchrec_cloud.metrics.prometheus import PrometheusSink

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
