"""``torchrec-cloud report``: curves and a one-screen summary of finished (or running) runs.

Reads the ``metrics.jsonl`` that rank 0 writes into ``--output_dir`` and draws PNG plots
of training loss, evaluation AUC and samples/s over steps; several runs are overlaid, one
colour per run, for comparison::

    torchrec-cloud report runs/quickstart                     # PNGs in runs/quickstart/report/
    torchrec-cloud report runs/lr-0.05 runs/lr-0.1 --output runs/compare

With one run the plots go to ``RUN_DIR/report/``; with several, to ``./report/`` unless
``--output`` says otherwise. A RUN_DIR may also be the path of a metrics.jsonl file.
Needs matplotlib (``pip install -e '.[report]'``).

The plots stay readable on what real runs do: a loss spike does not flatten the curve
(the axis stops at a high percentile; the points above it are drawn at the top edge, with
their value), resumes from a checkpoint are marked, runs whose global batches differ are
drawn against samples seen rather than steps, and the step axis always spans the whole
run, so a single evaluation is a point on it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from torchrec_cloud import install_extra

METRICS_FILE = "metrics.jsonl"


class ReportError(Exception):
    """A run folder or metrics file that cannot be reported on; the message says why."""


@dataclass
class Run:
    """The records of one run, by kind; train and eval records sorted by step."""

    name: str
    path: Path
    start: Optional[dict[str, Any]] = None
    end: Optional[dict[str, Any]] = None
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    skipped_last_line: bool = False

    def series(self, records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over ``records``, leaving out missing/non-finite values."""
        steps, values = [], []
        for r in records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                steps.append(int(r["step"]))
                values.append(float(v))
        return steps, values

    def global_batch(self) -> Optional[int]:
        """Samples per step over all ranks at the start (None when the run does not say)."""
        start = self.start or {}
        batch = ((start.get("config") or {}).get("data") or {}).get("batch_size")
        ranks = start.get("world_size")
        return batch * ranks if isinstance(batch, int) and isinstance(ranks, int) else None

    def samples_at(self, steps: list[int]) -> list[float]:
        """Samples seen after each of ``steps``: each step counts its own world size (a run
        resumed on another number of ranks changes it), from the train records."""
        batch = ((self.start or {}).get("config") or {}).get("data", {}).get("batch_size") or 0
        known, seen, previous = [(0, 0.0)], 0.0, 0
        for r in self.train:
            step = int(r["step"])
            seen += (step - previous) * batch * int(r.get("world_size") or 1)
            known.append((step, seen))
            previous = step
        return [_interpolate(known, s) for s in steps]


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """``points`` (sorted by x) read at ``x``, linearly; past the last point, its slope."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1)
    if len(points) < 2:
        return 0.0
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / max(x1 - x0, 1) * (x - x1)


def _by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the latest written winning: a resumed run repeats the steps
    after its last checkpoint, and the repeat is what the final model went through."""
    latest: dict[int, dict[str, Any]] = {}
    for r in records:
        if isinstance(r.get("step"), (int, float)):
            latest[int(r["step"])] = r
    return [latest[s] for s in sorted(latest)]


def load_run(path: str | Path, name: Optional[str] = None) -> Run:
    """Read a run folder (or its metrics.jsonl); :class:`ReportError` when there is nothing to plot."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such folder or file")
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        raise ReportError(
            f"{path}: no {METRICS_FILE} here; give the --output_dir of a training run "
            "(rank 0 writes metrics.jsonl there)"
        )
    run = Run(name=name or (path.name if path.is_dir() else path.parent.name) or str(path), path=file)
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    train, evals = [], {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if lineno == len(lines):
                # A run killed mid-write leaves half a last line; the rest is still good.
                run.skipped_last_line = True
                continue
            raise ReportError(
                f"{file}:{lineno}: not a JSON record ({e}); metrics.jsonl holds one JSON "
                "object per line, as the trainer writes it"
            ) from e
        event = record.get("event")
        if event == "start":
            run.start = record
        elif event == "end":
            run.end = record
        elif event == "train":
            train.append(record)
        elif event == "eval":
            evals.setdefault(str(record.get("split", "val")), []).append(record)
        elif event == "checkpoint":
            run.checkpoints.append(record)
        elif event == "resume":
            run.resumes.append(record)
    run.train = _by_step(train)
    run.evals = {split: _by_step(rs) for split, rs in evals.items()}
    if not run.train and not any(run.evals.values()):
        raise ReportError(
            f"{file}: no train or eval records yet (the run stopped before its first "
            "--log_every step?); nothing to plot"
        )
    return run


def _unique_names(paths: list[Path]) -> list[str]:
    names = [p.name if p.is_dir() else p.parent.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


# ---------------------------------------------------------------------------------------
# Plots.


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ReportError(f"plots need matplotlib: {install_extra('report')}") from e
    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _by_samples(runs: list[Run]) -> bool:
    """Whether steps would mislead: the runs' global batches differ, or one changed its
    number of ranks when it resumed."""
    batches = {r.global_batch() for r in runs}
    ranks_changed = any(len({t.get("world_size") for t in r.train} - {None}) > 1 for r in runs)
    return len(batches) > 1 or ranks_changed


def _loss_cap(values: list[float]) -> Optional[float]:
    """The top of the loss axis when a few values (a spike at the start) would otherwise
    flatten the rest: above the 95th percentile by half the range below it. None: no cap."""
    import numpy as np

    if len(values) < 5:
        return None
    low, high = float(np.min(values)), float(np.percentile(values, 95))
    cap = high + 0.5 * max(high - low, 1e-3)
    return cap if max(values) > cap else None


def write_plots(runs: list[Run], out_dir: Path) -> list[Path]:
    """Draw loss, AUC and samples/s PNGs for ``runs`` into ``out_dir``; return their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []
    by_samples = _by_samples(runs)

    def xs(run: Run, steps: list[int]) -> list[float]:
        return run.samples_at(steps) if by_samples else list(steps)

    x_end = max(xs(r, [_last_step(r)])[0] for r in runs) or 1

    def figure(title: str, ylabel: str):
        fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
        ax.set_title(title + (" (runs of different global batch sizes: against samples seen)" if by_samples else ""))
        ax.set_xlabel("samples seen" if by_samples else "step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        return fig, ax

    def save(fig, ax, name: str) -> None:
        ax.set_xlim(0, x_end * 1.03)  # the whole run, even for a single evaluation
        for i, run in enumerate(runs):  # resumes from a checkpoint: where the run restarted
            for j, resume in enumerate(run.resumes):
                x = xs(run, [int(resume.get("step") or 0)])[0]
                ax.axvline(x, color=colors[i % len(colors)], linestyle=":", linewidth=1.2,
                           label=f"{run.name} resumed" if j == 0 else None)  # fmt: skip
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    # Loss: training loss (solid) and held-out log loss (dashed, dots) per run.
    fig, ax = figure("Loss", "log loss")
    curves = []
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        steps, values = run.series(run.train, "loss")
        if steps:
            curves.append((xs(run, steps), values, dict(color=c, linewidth=1.2, label=f"{run.name} train")))
        steps, values = run.series(run.evals.get("val", []), "logloss")
        if steps:
            curves.append((xs(run, steps), values, dict(color=c, linestyle="--", marker="o", markersize=3,
                                                        label=f"{run.name} val")))  # fmt: skip
    cap = _loss_cap([v for _, values, _ in curves for v in values])
    for x, values, style in curves:
        ax.plot(x, [min(v, cap) if cap else v for v in values], **style)
        if cap:
            above = [(xx, v) for xx, v in zip(x, values) if v > cap]
            if above:
                ax.scatter([xx for xx, _ in above], [cap] * len(above), marker="^", s=50, color=style["color"], zorder=3,
                           label=f"{style['label'].rsplit(' ', 1)[0]} above the axis (max {max(v for _, v in above):.3g})")  # fmt: skip
    if cap:
        bottom = min(v for _, values, _ in curves for v in values)
        ax.set_ylim(bottom - 0.05 * (cap - bottom), cap + 0.03 * (cap - bottom))
    save(fig, ax, "loss.png")

    # AUC: validation curve, test AUC at its step, Bayes-optimal AUC of planted data.
    fig, ax = figure("AUC", "ROC AUC")
    shown = []
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        points: dict[str, list[tuple[float, float]]] = {}
        for split, style in (("val", dict(marker="o", markersize=4)), ("test", dict(marker="*", markersize=12, linestyle="none"))):
            steps, values = run.series(run.evals.get(split, []), "auc")
            if steps:
                x = xs(run, steps)
                ax.plot(x, values, color=c, label=f"{run.name} {split}", zorder=3, **style)
                shown += values
                points[split] = list(zip(x, values))
        _annotate_few(ax, points)
        bayes = (run.start or {}).get("bayes_auc")
        if isinstance(bayes, (int, float)):
            ax.axhline(bayes, color=c, linestyle=":", linewidth=1, label=f"{run.name} val Bayes-optimal {bayes:.4f}")
            shown.append(bayes)
    if shown:
        low, high = min(shown), max(shown)
        pad = max(0.02 - (high - low), 0) / 2 + 0.1 * (high - low)  # at least 0.02 tall
        ax.set_ylim(low - pad - 0.005, high + pad + 0.005)
    else:
        ax.text(0.5, 0.5, "no evaluation records yet", ha="center", va="center", transform=ax.transAxes)
    save(fig, ax, "auc.png")

    fig, ax = figure("Throughput", "samples / s")
    for i, run in enumerate(runs):
        steps, values = run.series(run.train, "samples_per_s")
        if steps:
            ax.plot(xs(run, steps), values, color=colors[i % len(colors)], linewidth=1.2, label=run.name)
    ax.set_ylim(bottom=0)
    save(fig, ax, "samples_per_s.png")
    return written


def _annotate_few(ax, points: dict[str, list[tuple[float, float]]]) -> None:
    """Write the values of a split with three points or fewer beside them, named: at a step
    where val and test both have a point, the higher one's label above it and the lower
    one's below, so each label sits by its own point."""
    for split, xy in points.items():
        if len(xy) > 3:
            continue
        others = {x: v for name, pts in points.items() if name != split for x, v in pts}
        for x, v in xy:
            above = v >= others[x] if x in others else split == "val"
            ax.annotate(f"{split} {v:.4f}", (x, v), textcoords="offset points", fontsize="small",
                        xytext=(6, 6 if above else -14))


def _last_step(run: Run) -> int:
    return max([int(r["step"]) for r in run.train] + [int(r["step"]) for rs in run.evals.values() for r in rs])


# ---------------------------------------------------------------------------------------
# Summary.


def _fmt(value: Any, spec: str = ".4f") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    return "-"


def _last(records: list[dict[str, Any]], key: str) -> Any:
    for r in reversed(records):
        if r.get(key) is not None:
            return r[key]
    return None


def summarize(run: Run) -> dict[str, Any]:
    """The figures of the summary table for one run."""
    _, throughput = run.series(run.train, "samples_per_s")
    # The first window includes warm-up (planner, first batches); leave it out when we can.
    steady = throughput[1:] if len(throughput) > 2 else throughput
    start, end = run.start or {}, run.end or {}
    wall = None
    if isinstance(start.get("time"), (int, float)) and isinstance(end.get("time"), (int, float)):
        wall = end["time"] - start["time"]
    last_step = _last_step(run)
    val = run.evals.get("val", [])
    test = run.evals.get("test", [])
    _, val_aucs = run.series(val, "auc")
    # The Bayes-optimal AUC of the split the final figure is on (planted data: each split
    # has its own), and how far the test AUC is from it.
    bayes_test = _last(test, "bayes_auc") or (start.get("bayes_auc_by_split") or {}).get("test")
    test_auc = _last(test, "auc")
    return {
        "name": run.name,
        "status": "finished" if run.end else "incomplete",
        "steps": last_step,
        "world_size": start.get("world_size") or _last(run.train, "world_size"),
        "preset": (start.get("config") or {}).get("preset"),
        "loss_first": run.train[0].get("loss") if run.train else None,
        "loss_last": _last(run.train, "loss"),
        "samples_per_s": statistics.median(steady) if steady else None,
        "val_auc_last": _last(val, "auc"),
        "val_auc_best": max(val_aucs) if val_aucs else None,
        "val_logloss_last": _last(val, "logloss"),
        "test_auc": test_auc,
        "test_logloss": _last(test, "logloss"),
        "bayes_auc": start.get("bayes_auc"),
        "bayes_auc_test": bayes_test,
        "bayes_gap_test": bayes_test - test_auc if bayes_test is not None and test_auc is not None else None,
        "wall_s": wall,
        "checkpoints": len(run.checkpoints),
        "checkpoint_save_s": statistics.mean(c["seconds"] for c in run.checkpoints
                                             if isinstance(c.get("seconds"), (int, float)))
        if any(isinstance(c.get("seconds"), (int, float)) for c in run.checkpoints) else None,
        "resumes": len(run.resumes),
        "data_wait_share": _data_wait_share(run),
    }


def _data_wait_share(run: Run) -> Optional[float]:
    """Fraction of step time spent waiting for input batches (over train records that say)."""
    wait = [r["data_wait_s"] for r in run.train if isinstance(r.get("data_wait_s"), (int, float))
            and isinstance(r.get("step_s"), (int, float)) and r["step_s"] > 0]
    total = [r["step_s"] for r in run.train if isinstance(r.get("data_wait_s"), (int, float))
             and isinstance(r.get("step_s"), (int, float)) and r["step_s"] > 0]
    return sum(wait) / sum(total) if total else None


def format_summary(runs: list[Run], plots: list[Path]) -> str:
    """A table with one row per run, then notes; fits one screen for a handful of runs."""
    rows = [summarize(r) for r in runs]
    width = max(12, *(len(r["name"]) for r in rows))
    head = (f"{'run':<{width}}  {'steps':>7}  {'ranks':>5}  {'loss':>15}  {'samples/s':>10}  "
            f"{'val AUC':>7}  {'test AUC':>8}  {'test Bayes':>10}  {'gap':>6}  {'time':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        loss = f"{_fmt(r['loss_first'], '.3f')}->{_fmt(r['loss_last'], '.3f')}"
        wall = f"{r['wall_s']:.0f}s" if r["wall_s"] is not None else "-"
        lines.append(
            f"{r['name']:<{width}}  {r['steps']:>7}  {_fmt(r['world_size'], '.0f'):>5}  {loss:>15}  "
            f"{_fmt(r['samples_per_s'], ',.0f'):>10}  {_fmt(r['val_auc_last']):>7}  "
            f"{_fmt(r['test_auc']):>8}  {_fmt(r['bayes_auc_test']):>10}  {_fmt(r['bayes_gap_test']):>6}  {wall:>8}"
        )
    lines.append("")
    for r, run in zip(rows, runs):
        notes = [r["status"]]
        if r["preset"]:
            notes.append(f"preset {r['preset']}")
        if r["val_auc_best"] is not None:
            notes.append(f"best val AUC {_fmt(r['val_auc_best'])}")
        if r["test_logloss"] is not None:
            notes.append(f"test log loss {_fmt(r['test_logloss'])}")
        if r["data_wait_share"] is not None:
            notes.append(f"{r['data_wait_share']:.0%} of step time waiting for data")
        if r["checkpoints"]:
            notes.append(f"{r['checkpoints']} checkpoints (save {_fmt(r['checkpoint_save_s'], '.2f')}s avg)")
        if r["resumes"]:
            notes.append(f"resumed {r['resumes']}x")
        if run.skipped_last_line:
            notes.append("last line cut off (run killed mid-write?)")
        lines.append(f"{r['name']}: " + ", ".join(notes))
    if plots:
        lines.append("")
        lines.append("plots: " + ", ".join(str(p) for p in plots))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The sub-command.


def run_report(paths: list[str], output: Optional[str] = None) -> tuple[list[Run], list[Path], str]:
    """Load ``paths``, write the plots, and return (runs, plot paths, summary text)."""
    resolved = [Path(p) for p in paths]
    runs = [load_run(p, n) for p, n in zip(resolved, _unique_names(resolved))]
    if output is not None:
        out_dir = Path(output)
    elif len(runs) == 1:
        out_dir = runs[0].path.parent / "report"
    else:
        out_dir = Path("report")
    plots = write_plots(runs, out_dir)
    return runs, plots, format_summary(runs, plots)


def _main(ns: argparse.Namespace) -> int:
    try:
        _, _, summary = run_report(ns.run_dirs, ns.output)
    except ReportError as e:
        print(f"torchrec-cloud report: error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report",
        help="plot loss, AUC and samples/s of one or more runs and print a summary",
        description="Plot loss, AUC and samples/s over steps of one or more runs (overlaid) "
        "as PNG files, and print a one-screen summary.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a training run's --output_dir (or its metrics.jsonl); several are overlaid")
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="folder for the PNG files (default: RUN_DIR/report for one run, ./report for several)")
    parser.set_defaults(func=_main)
    return parser
