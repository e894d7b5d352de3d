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
from typing import Any, Iterable, Optional


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


# Scalars worth a TensorBoard curve, per event, under ``<split>/``: the groups are train,
# val and test only (TensorBoard lists groups alphabetically: nothing else comes first),
# and each value once (a train record's ``logloss`` repeats its ``loss``; an evaluation's
# ``loss`` its ``logloss``).
_TB_KEYS = {
    "train": ("loss", "samples_per_s", "lr"),
    "eval": ("auc", "bayes_auc", "logloss", "ne"),
    "checkpoint": ("seconds",),
}
# The Custom Scalars tab: a split's curves on one chart, with the best possible AUC.
_TB_LAYOUT = {
    "torchrec-cloud": {
        "AUC (val, test, Bayes-optimal)": ["Multiline", [r"val/auc", r"val/bayes_auc", r"test/auc", r"test/bayes_auc"]],
        "loss (train, val)": ["Multiline", [r"train/loss", r"val/logloss"]],
    }
}


class TensorBoardSink(MetricsSink):
    """Writes train and evaluation records as scalars ``<split>/<key>`` (``_TB_KEYS``), and
    a checkpoint's save time as ``train/checkpoint_s``."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard lazily

        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._writer.add_custom_scalars(_TB_LAYOUT)

    def log(self, record: dict[str, Any]) -> None:
        event, step = record.get("event"), record.get("step")
        if event not in _TB_KEYS or step is None:
            return
        prefix = "train" if event == "checkpoint" else record.get("split") or event
        for key in _TB_KEYS[event]:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                tag = "checkpoint_s" if event == "checkpoint" else key
                self._writer.add_scalar(f"{prefix}/{tag}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _clip(line: str, limit: int = 200) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."


class ConsoleSink(MetricsSink):
    """What rank 0 prints, one plain line per record worth reading (no carriage returns, at
    most ~200 characters), so a pod's log reads as well as a terminal:

    - each train record (every ``--log_every`` steps): step, loss, the last validation AUC,
      samples/s and the time left; unless ``train_lines`` is off (a progress bar shows them);
    - each evaluation, with the Bayes-optimal AUC and the gap where the data knows it;
    - checkpoints, resumes, and an end line with rounded figures and where to look next.
    """

    def __init__(self, write=print, train_lines: bool = True, output_dir: Optional[str] = None,
                 tensorboard: bool = True) -> None:  # fmt: skip
        self._write = write
        self.train_lines = train_lines
        self.output_dir = output_dir
        self.tensorboard = tensorboard
        self.total_steps: Optional[int] = None
        self._since: Optional[tuple[float, int]] = None  # (time, step) this process started training from
        self._val_auc: Optional[float] = None
        self._test: Optional[dict[str, Any]] = None

    def _say(self, line: str) -> None:
        self._write(_clip(line))

    def log(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event in ("start", "resume"):
            self.total_steps = record.get("total_steps", self.total_steps)
            self._since = (time.monotonic(), int(record.get("step") or 0))
        if event == "resume":
            self._say(f"[resume] step {record['step']} from {record.get('path')} "
                      f"(saved by {record.get('saved_world_size')} rank(s), {record.get('seconds', 0):.1f}s)")  # fmt: skip
        elif event == "train" and self.train_lines:
            self._say(self._train_line(record))
        elif event == "eval":
            self._say(_eval_line(record))
            if record.get("split") == "val":
                self._val_auc = record.get("auc")
            elif record.get("split") == "test":
                self._test = record
        elif event == "checkpoint":
            mib = (record.get("bytes") or 0) / 2**20
            self._say(f"[checkpoint] step {record['step']} saved to {record.get('path')} "
                      f"({mib:,.1f} MiB in {record.get('seconds', 0):.1f}s, {record.get('reason')})")  # fmt: skip
        elif event == "end":
            for line in self._end_lines(record):
                self._say(line)

    def _train_line(self, r: dict[str, Any]) -> str:
        step = r["step"]
        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        if isinstance(r.get("loss"), (int, float)):
            parts.append(f"loss {r['loss']:.4f}")
        if self._val_auc is not None:
            parts.append(f"val AUC {self._val_auc:.4f}")
        if isinstance(r.get("samples_per_s"), (int, float)):
            parts.append(f"{r['samples_per_s']:,.0f} samples/s")
        if self.total_steps and self._since is not None and step > self._since[1]:
            per_step = (time.monotonic() - self._since[0]) / (step - self._since[1])
            parts.append(f"ETA {_duration(per_step * max(self.total_steps - step, 0))}")
        return "  ".join(parts)

    def _end_lines(self, r: dict[str, Any]) -> list[str]:
        head = f"[end] step {r['step']}"
        if r.get("preempted"):
            head += ": stopped for a preemption, exit code 200 (with --checkpoint_path, the same command resumes)"
        else:
            head += f" in {_duration(r.get('seconds') or 0)} ({r.get('samples_per_s', 0):,.0f} samples/s)"
            if self._test is not None and self._test.get("auc") is not None:
                head += f"; test AUC {self._test['auc']:.3f}"
                if self._test.get("bayes_auc") is not None:
                    head += f" (Bayes-optimal {self._test['bayes_auc']:.3f})"
        lines = [head]
        if self.output_dir:
            folder = self.output_dir
            lines.append(f"      metrics: {folder}/metrics.jsonl; plots and a summary: torchrec-cloud report {folder}")
            if self.tensorboard:
                lines.append(f"      curves: tensorboard --logdir {folder}")
        return lines


def _eval_line(r: dict[str, Any]) -> str:
    parts = [f"[{r.get('split')}] step {r.get('step')}"]
    if r.get("auc") is not None:
        auc = f"AUC {r['auc']:.4f}"
        if r.get("bayes_auc") is not None:
            auc += f" (Bayes-optimal {r['bayes_auc']:.4f}, gap {r['bayes_auc'] - r['auc']:.4f})"
        parts.append(auc)
    if r.get("logloss") is not None:
        parts.append(f"log loss {r['logloss']:.4f}")
    if r.get("ne") is not None:
        parts.append(f"NE {r['ne']:.4f}")
    rows, split_rows = r.get("rows"), r.get("split_rows")
    if isinstance(rows, int) and isinstance(split_rows, int) and rows < split_rows:
        parts.append(f"(a sample: {rows:,} of {split_rows:,} rows, --eval_rows)")
    return "  ".join(parts)


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
