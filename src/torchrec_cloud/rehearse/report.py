"""What the rehearsal saw: the run's progress as it goes (rank 0's metrics.jsonl), whether
each pod served its metrics, and the report ``--json`` prints::

    completed     the job completed as its controller sees it, and the run finished
    outcome       "complete", the controller's failure reason, or "timed out"
    pods          per pod: exit_codes, notes, logs (one per attempt), metrics_served
    restarts      pods the controllers started again
    faults        each fault and whether it fired
    final         the last val/test AUC and log loss, and their step
    resumes       the step of each resume record
    resumed_from  per restart (every start after the first), the checkpoint step it
                  resumed from (0: from the beginning)

Each fault also says what it cost, as far as this machine can tell (wall-clock figures for
bench/RESULTS.md, never for tests): ``lost_steps``, the steps trained past the checkpoint
the next start resumed from, and ``downtime_s``, from the fault to the first step the next
start logged.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

from torchrec_cloud.progress import plural


class Progress:
    """The train records rank 0 has logged (its metrics.jsonl), in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.steps: list[int] = []  # the step of every train record so far
        self.starts: list[tuple[float, int]] = []  # per start of the trainer: (when seen, resumed from)
        self.first_steps: dict[int, float] = {}  # start number -> when its first train record was seen
        self.last_steps: dict[int, int] = {}  # start number -> the last step it logged

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event, now = record.get("event"), time.monotonic()
            if event == "train":
                self.steps.append(int(record["step"]))
                self.first_steps.setdefault(len(self.starts), now)
                self.last_steps[len(self.starts)] = int(record["step"])
            elif event == "start":
                self.starts.append((now, 0))
            elif event == "resume" and self.starts:
                self.starts[-1] = (self.starts[-1][0], int(record["step"]))

    @property
    def mark(self) -> int:
        return len(self.steps)

    def mark_of(self, attempt) -> int:
        return self.mark

    def step_since(self, mark: int) -> int:
        """The latest step logged after ``mark`` (-1: none yet)."""
        return self.steps[-1] if len(self.steps) > mark else -1

    def step_of(self, attempt) -> int:
        """A fault's STEP as ``attempt`` has seen it: the run's latest step, once it logged one."""
        return self.step_since(attempt.progress_mark)


class ShareProgress:
    """A preprocessing job's progress: the shards each share has committed (their ``.done``
    markers under the dataset's output; input ``s`` belongs to share ``s mod shares``). A
    fault's STEP is a count of them: ``--kill 1@2`` fires once share 1 has committed two
    shards, one of them by the attempt running then."""

    def __init__(self, dataset: str, shares: int) -> None:
        self.dataset, self.shares = dataset, shares

    def poll(self) -> None:
        pass

    def committed(self, index: int) -> int:
        from torchrec_cloud import storage
        from torchrec_cloud.data.dataset import SHARD_DIR

        try:
            names = storage.listdir(storage.join(self.dataset, SHARD_DIR))
        except storage.StorageNotFoundError:
            return 0
        return sum(1 for n in names if n.endswith(".done") and n[:5].isdigit() and int(n[:5]) % self.shares == index)

    def mark_of(self, attempt) -> int:
        return self.committed(attempt.index)

    def step_of(self, attempt) -> int:
        done = self.committed(attempt.index)
        return done if done > attempt.progress_mark else -1


def scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
            return b"\ntorchrec_train_step{" in r.read()
    except OSError:
        return False


def costs(fault, progress: Progress) -> dict[str, Any]:
    """``lost_steps`` (the last step logged before the next start, less the step it resumed
    from: exact with ``--log_every 1``) and ``downtime_s`` of a fault that fired (None where
    the run never trained again)."""
    if fault.fired_at is None:
        return {"lost_steps": None, "downtime_s": None}
    later = [i for i, (seen, _) in enumerate(progress.starts, start=1) if seen > fault.fired_at]
    if not later:
        return {"lost_steps": None, "downtime_s": None}
    resumed = progress.starts[later[0] - 1][1]
    back = progress.first_steps.get(later[0])
    trained = progress.last_steps.get(later[0] - 1, fault.fired_step)  # the last step before the restart
    return {"lost_steps": trained - resumed,
            "downtime_s": round(back - fault.fired_at, 1) if back is not None else None}  # fmt: skip


def build(spec, controller, faults, served, run_dir: Optional[Path], timed_out: bool, output: Path,
          progress, dataset: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
    """The report; ``dataset``: a preprocessing job's output, whose manifest says it finished
    (``final``: its rows and shards) where a training run's records do."""
    records = []
    if run_dir is not None and (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    final: dict[str, Any] = {}
    for split in ("val", "test"):
        evals = [r for r in records if r.get("event") == "eval" and r.get("split") == split]
        if evals:
            final[f"{split}_auc"], final[f"{split}_logloss"] = evals[-1]["auc"], evals[-1]["logloss"]
            final["step"] = evals[-1]["step"]
    ends = [r for r in records if r.get("event") == "end"]
    finished_run = bool(ends) and not ends[-1].get("preempted")
    if dataset is not None:
        manifest = _manifest(dataset)
        finished_run = manifest is not None
        if manifest is not None:
            final = {"rows": manifest["rows"], "shards": len(manifest["shards"])}
    completed = controller.outcome == "complete" and finished_run and not timed_out
    starts: list[int] = []  # per start of the trainer: the step it resumed from
    for r in records:
        if r.get("event") == "start":
            starts.append(0)
        elif r.get("event") == "resume" and starts:
            starts[-1] = int(r["step"])
    return {
        "completed": completed,
        "outcome": "timed out" if timed_out else controller.outcome,
        "launcher": spec.launcher,
        "nodes": spec.nodes,
        "pods": [
            {
                "index": i,
                "exit_codes": [a.exit_code for a in controller.attempts[i]],
                "notes": [a.note for a in controller.attempts[i]],
                "logs": [str(a.log) for a in controller.attempts[i]],
                "metrics_served": served[i],
            }
            for i in range(spec.nodes)
        ],
        "restarts": controller.restarts,
        "faults": [{**{k: v for k, v in dataclasses.asdict(f).items() if k != "fired_at"},
                    **(costs(f, progress) if isinstance(progress, Progress) else {})} for f in faults],  # fmt: skip
        "final": final,
        "resumes": [r["step"] for r in records if r.get("event") == "resume"],
        "resumed_from": starts[1:],
        "output": str(output),
    }


def _manifest(dataset: str) -> Optional[dict[str, Any]]:
    """The dataset's manifest as written (None while there is none)."""
    from torchrec_cloud import storage
    from torchrec_cloud.data.dataset import MANIFEST, MAX_MANIFEST_BYTES
    from torchrec_cloud.untrusted import read_json

    url = storage.join(dataset, MANIFEST)
    return read_json(url, MAX_MANIFEST_BYTES) if storage.exists(url) else None


def summary(report: dict[str, Any]) -> str:
    lines = []
    for f in report["faults"]:
        if f["fired"] and f.get("downtime_s") is not None:
            lines.append(f"--{f['kind']} {f['pod']}@{f['step']}: fired at step {f['fired_step']}; {f['lost_steps']} "
                         f"step(s) lost; training again {f['downtime_s']:g} s later")  # fmt: skip
    lines.append(f"{'pod':>4}  exit codes (one per attempt)")
    lines += [f"{pod['index']:>4}  {' '.join(str(c) for c in pod['exit_codes'])}" for pod in report["pods"]]
    final = report["final"]
    scores = ", ".join(f"{k} {v:.6f}" if isinstance(v, float) else f"{k} {v}" for k, v in final.items() if k != "step")
    resumed = ", ".join(str(s) for s in report["resumed_from"])
    lines.append(f"{'completed' if report['completed'] else 'NOT completed'} ({report['outcome']}); "
                 f"{plural(report['restarts'], 'restart')}" + (f", resumed from step {resumed}" if resumed else "")
                 + f"; {scores or 'no evaluation'}")  # fmt: skip
    return "\n".join(lines)
