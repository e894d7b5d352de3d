"""The metrics interface and the sinks rank 0 writes: JSON lines, TensorBoard, console.

The training loop calls :meth:`MetricsSink.log` with flat records (``event``, ``step``,
``split``, ``loss``, ``auc``, ``logloss``, ``samples_per_s``, ``world_size``, ...). Rank 0
writes them; other ranks get :class:`NullSink`. Optional backends (TensorBoard) are
imported only when their sink is built.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable


class MetricsSink:
    """A destination for metric records. The default does nothing."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class NullSink(MetricsSink):
    """What non-zero ranks use."""


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink(MetricsSink):
    """Appends one JSON object per record to ``metrics.jsonl``, flushed per line."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# Scalars worth a TensorBoard curve, per record.
_TB_KEYS = ("loss", "auc", "logloss", "ne", "samples_per_s", "lr", "seconds", "bytes")


class TensorBoardSink(MetricsSink):
    """Writes numeric fields of train/eval records as scalars ``<split>/<key>``."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard lazily

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if step is None:
            return
        prefix = record.get("split") or record.get("event", "misc")
        for key in _TB_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    self._writer.add_scalar(f"{prefix}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ConsoleSink(MetricsSink):
    """Prints eval and lifecycle records as one line each (train records go to the bar)."""

    def __init__(self, write=print) -> None:
        self._write = write

    def log(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "eval":
            parts = [f"[{record['split']}] step {record['step']}"]
            for key in ("auc", "logloss", "ne", "bayes_auc"):
                if record.get(key) is not None:
                    parts.append(f"{key} {record[key]:.4f}")
            self._write("  ".join(parts))
        elif event in ("checkpoint", "resume", "end"):
            fields = {k: v for k, v in record.items() if k not in ("event", "time", "config")}
            self._write(f"[{event}] " + "  ".join(f"{k}={v}" for k, v in fields.items()))


class MultiSink(MetricsSink):
    """Fans a record out to several sinks."""

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
