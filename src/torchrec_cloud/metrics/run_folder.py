"""The run folder: where a run's metrics.jsonl and TensorBoard events go, so runs never mix.

``--output_dir`` names the folder. Before rank 0 writes anything there, :func:`choose`
decides whether that folder is this run's:

- a folder that does not exist, or holds no run yet (no ``metrics.jsonl`` with a ``start``
  record), is used as it is;
- a folder whose run is this one continuing is appended to: its last run did not finish
  (no ``end`` record, or one that says ``preempted``), has the same config (the ``output``
  flags aside), and checkpoints (``--checkpoint_path`` or ``--resume_from``), so this run
  resumes from them. That is a pod restarted after a preemption or a crash, or the same
  command run again after exit code 200: it repeats the same ``--output_dir``;
- any other run there (a finished one, another config, or one without checkpoints that a
  new start would repeat from step 0) is left alone, and this run writes to ``DIR-2``,
  ``DIR-3``, ... : the first of those that holds no run, or holds this run continuing.

A new folder rather than an error, because the quickstart's and the presets' default
``--output_dir`` is the same every time: a second ``make quickstart`` must work, and
TensorBoard (``--logdir`` of the parent) then shows each run as its own curve::

    folder, note = choose("runs/quickstart", cfg.to_dict())   # Path("runs/quickstart-2"), "..."
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

METRICS_FILE = "metrics.jsonl"


def last_run(folder: Path) -> Optional[tuple[dict[str, Any], Optional[dict[str, Any]]]]:
    """The last ``start`` record in ``folder``'s metrics.jsonl and the ``end`` record after
    it (None while running or after a crash); None when the folder holds no run."""
    path = folder / METRICS_FILE
    if not path.is_file():
        return None
    from torchrec_cloud.untrusted import capped_lines

    start, end = None, None
    with open(path, "rb") as f:
        for line in capped_lines(f):  # a folder from elsewhere may hold a file without newlines
            try:
                record = json.loads(line.decode("utf-8", errors="replace")) if line is not None else None
            except (ValueError, RecursionError):
                continue  # a line cut short by a kill
            if not isinstance(record, dict):
                continue
            if record.get("event") == "start":
                start, end = record, None
            elif record.get("event") == "end":
                end = record
    return None if start is None else (start, end)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The config as a run's start record holds it, without the flags that only say where
    and how to show the run's output."""
    return {k: v for k, v in json.loads(json.dumps(config)).items() if k != "output"}


def _why_not(folder: Path, config: dict[str, Any]) -> Optional[str]:
    """None when this run may write to ``folder``; otherwise why not, in a few words."""
    last = last_run(folder)
    if last is None:
        return None
    start, end = last
    if end is not None and not end.get("preempted"):
        return "a finished run"
    if _comparable(start.get("config") or {}) != _comparable(config):
        return "a run with another config"
    checkpoint = config.get("checkpoint") or {}
    if not (checkpoint.get("checkpoint_path") or checkpoint.get("resume_from")):
        return "an unfinished run without checkpoints to resume"
    return None


def choose(output_dir: str, config: dict[str, Any]) -> tuple[Path, Optional[str]]:
    """The folder this run writes to, and a line saying why it is not ``output_dir`` (None
    when it is). ``config`` is the run's ``JobConfig.to_dict()``."""
    base = Path(output_dir)
    why = _why_not(base, config)
    if why is None:
        return base, None
    n = 2
    while True:
        candidate = base.with_name(f"{base.name}-{n}")
        if _why_not(candidate, config) is None:
            return candidate, f"{base} holds {why}; this run writes to {candidate}"
        n += 1
