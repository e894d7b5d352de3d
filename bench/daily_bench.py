"""Seven days of a drifting world, trained three ways (issue #42): next-day test AUC and
samples trained per day.

The world: data/events_gen.py with ``Drift`` (new items each day at the top of the popularity
ranking, the older ones' ranking rotating, users churning), so yesterday's model meets ids it
never saw. Day d's rows train (80%) and validate (10%, by a hash of each row); every row of day
d + 1 is day d's next-day test, scored with ``predict --input`` through the model's own
transforms (an id it never saw goes to row 0), whose Bayes-optimal AUC is known.

- (a) ``warm``: day d is preprocessed with ``--vocab_from`` day d-1's dataset (ids keep their
  rows) and trained with ``train --warm_start`` day d-1's checkpoint on day d's rows only;
  day 0 is (b)'s day 0.
- (b) ``cold``: a model trained from scratch on days 0..d every day (its own vocabulary).
- (c) ``frozen``: day 0's model, never trained again.

Samples trained per day: the training split's rows times ``--epochs`` (what each day's run
reads). The issue's goals: (a) within 0.002 of (b) every day, at no more than 1/3 of (b)'s
samples by day 7, and above (c) from day 2; the last lines say which hold.

(a) needs ``train --warm_start`` (the training half of issue #42): without it the script stops
at once, saying so, unless ``--approaches cold,frozen``. Quality figures are not timings
(seeds fixed), but each day trains once per approach: about 30 runs of a small model::

    python bench/daily_bench.py --json
    python bench/daily_bench.py --approaches cold,frozen --json
    python bench/daily_bench.py --days 3 --rows_per_day 5000 --work /tmp/daily     # a quick look, kept

The last line with --json is one JSON object: per approach and day, the AUC and samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from torchrec_cloud.data import events_gen  # noqa: E402

APPROACHES = ("warm", "cold", "frozen")
# The events' columns as the daily loop would map them: users and items by growing
# vocabularies (capacity to spare for a week of new ones; ids unseen for 3 days may go), tags
# by a vocabulary too, the recent items' ids by modulo.
SCHEMA = """
name: daily
label: {column: clicked}
dense:
  - {name: price, transform: log1p}
  - {name: views, transform: standardize}
sparse:
  - {name: user, type: string, mapping: vocab, num_embeddings: 4000, min_count: 2, evict_after: 3}
  - {name: item, type: int, mapping: vocab, num_embeddings: 2000, min_count: 2, evict_after: 3}
  - {name: tags, type: string, list: true, mapping: vocab, num_embeddings: 100, pooling: mean}
  - {name: recent, type: int, list: true, mapping: modulo, num_embeddings: 1000}
"""


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def command(*argv: str) -> str:
    """``torchrec-cloud ARGV`` in a process of its own; its stdout, or the script stops with its output."""
    proc = subprocess.run([sys.executable, "-m", "torchrec_cloud", *argv], env=env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"daily_bench: torchrec-cloud {' '.join(argv[:2])} ... failed (exit {proc.returncode}):\n"
                         + proc.stdout[-2000:] + proc.stderr[-4000:])  # fmt: skip
    return proc.stdout


def has_warm_start() -> bool:
    return "--warm_start" in command("train", "--help")


class Day:
    """One approach's artefacts of one day under ``folder``: dataset, checkpoints, model."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.data, self.ck, self.run, self.model = (folder / n for n in ("data", "ck", "run", "model"))


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        (work / "schema.yaml").write_text(SCHEMA)
        drift = events_gen.Drift(new_items=args.new_items, popularity_shift=args.popularity_shift, user_churn=args.user_churn)
        self.events = events_gen.write_events(str(work / "events"), days=args.days + 1, rows_per_day=args.rows_per_day,
                                              seed=args.seed, drift=drift)  # fmt: skip
        self.files = self.events["files"]

    def preprocess(self, day: Day, inputs: list[str], vocab_from: Day | None = None) -> None:
        argv = ["data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(self.work / "schema.yaml"),
                "--input", *inputs, "--output", str(day.data)]  # fmt: skip
        if vocab_from is not None:
            argv += ["--vocab_from", str(vocab_from.data)]
        command(*argv)

    def train(self, day: Day, warm_start: Day | None = None) -> int:
        """Train on ``day``'s dataset (from ``warm_start``'s checkpoint), export the model; the
        samples trained."""
        a = self.args
        epochs = a.epochs if warm_start is None else a.warm_epochs or a.epochs
        rate = a.learning_rate if warm_start is None else a.warm_learning_rate or a.learning_rate
        argv = ["train", "--dataset_path", str(day.data), "--batch_size", str(a.batch_size), "--num_epochs", str(epochs),
                "--learning_rate", str(rate), "--embedding_dim", "16", "--dense_arch_layer_sizes", "64,16",
                "--over_arch_layer_sizes", "128,64,1", "--eval_every", "0", "--shuffle", "--no-progress",
                "--no-tensorboard", "--checkpoint_path", str(day.ck), "--output_dir", str(day.run)]  # fmt: skip
        if warm_start is not None:
            argv += ["--warm_start", str(warm_start.ck)]
        command(*argv)
        command("export", str(day.ck), "--output", str(day.model))
        manifest = json.loads((day.data / "manifest.json").read_text())
        return epochs * sum(end - start for _, start, end in manifest["splits"]["train"])

    def next_day_auc(self, day: Day, d: int) -> float:
        """AUC of ``day``'s model on every row of day d + 1."""
        scores = day.folder / f"scores_{d + 1}.csv"
        out = command("predict", str(day.model), "--input", self.files[d + 1], "--output", str(scores), "--json", "--no_progress")
        return json.loads(out.strip().splitlines()[-1])["auc"]

    def run(self, approaches: list[str]) -> dict:
        days = self.args.days
        out = {a: {"auc": [], "samples": []} for a in approaches}
        cold = [Day(self.work / "cold" / f"day_{d}") for d in range(days)]
        warm = [cold[0]] + [Day(self.work / "warm" / f"day_{d}") for d in range(1, days)]
        day0_samples = None
        for d in range(days):
            if "cold" in approaches or d == 0:
                self.preprocess(cold[d], self.files[: d + 1])
                samples = self.train(cold[d])
                day0_samples = samples if d == 0 else day0_samples
                if "cold" in approaches:
                    out["cold"]["auc"].append(self.next_day_auc(cold[d], d))
                    out["cold"]["samples"].append(samples)
            if "warm" in approaches:
                if d == 0:
                    samples = day0_samples
                else:
                    self.preprocess(warm[d], [self.files[d]], vocab_from=warm[d - 1])
                    samples = self.train(warm[d], warm_start=warm[d - 1])
                out["warm"]["auc"].append(self.next_day_auc(warm[d], d))
                out["warm"]["samples"].append(samples)
            if "frozen" in approaches:
                out["frozen"]["auc"].append(self.next_day_auc(cold[0], d))
                out["frozen"]["samples"].append(day0_samples if d == 0 else 0)
            print(f"day {d}: " + ", ".join(f"{a} {out[a]['auc'][-1]:.4f}" for a in approaches), file=sys.stderr, flush=True)
        out["bayes_auc_next_day"] = self.events["bayes_auc_by_day"][1 : days + 1]
        return out


def goals(out: dict) -> list[str]:
    """The issue's three goals, each with whether it holds."""
    if not all(a in out for a in APPROACHES):
        return ["goals: need all three approaches"]
    warm, cold, frozen = out["warm"], out["cold"], out["frozen"]
    gap = max(c - w for w, c in zip(warm["auc"], cold["auc"]))
    ratio = warm["samples"][-1] / cold["samples"][-1]
    above = all(w > f for w, f in zip(warm["auc"][2:], frozen["auc"][2:]))
    return [f"(a) within 0.002 of (b) every day: {'yes' if gap <= 0.002 else 'no'} (largest shortfall {gap:+.4f})",
            f"(a)'s samples on the last day <= 1/3 of (b)'s: {'yes' if ratio <= 1 / 3 else 'no'} ({ratio:.3f})",
            f"(a) above (c) from day 2: {'yes' if above else 'no'}"]  # fmt: skip


def table(out: dict, approaches: list[str]) -> str:
    head = "| day | next-day Bayes AUC | " + " | ".join(f"{a} AUC" for a in approaches) + " | " + " | ".join(
        f"{a} samples" for a in approaches) + " |"  # fmt: skip
    lines = [head, "| " + " | ".join(["---"] + ["---:"] * (1 + 2 * len(approaches))) + " |"]
    for d, bayes in enumerate(out["bayes_auc_next_day"]):
        lines.append(f"| {d} | {bayes:.4f} | " + " | ".join(f"{out[a]['auc'][d]:.4f}" for a in approaches) + " | "
                     + " | ".join(f"{out[a]['samples'][d]:,}" for a in approaches) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--approaches", default=",".join(APPROACHES), help="comma-separated: warm, cold, frozen")
    p.add_argument("--days", type=int, default=7, help="days trained (one more is generated: the last day's next day)")
    p.add_argument("--rows_per_day", type=int, default=20_000)
    p.add_argument("--new_items", type=int, default=40, help="drift: items that appear each day")
    p.add_argument("--popularity_shift", type=float, default=0.05,
                   help="drift: the older items' ranking rotates by this fraction a day")
    p.add_argument("--user_churn", type=float, default=0.1, help="drift: the fraction of users replaced each day")
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--learning_rate", type=float, default=0.03)
    p.add_argument("--warm_epochs", type=int, default=None, help="(a)'s epochs over each day (default: --epochs)")
    p.add_argument("--warm_learning_rate", type=float, default=None, help="(a)'s learning rate (default: --learning_rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, metavar="DIR",
                   help="keep every dataset, checkpoint and model here (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    approaches = [a.strip() for a in args.approaches.split(",") if a.strip()]
    unknown = [a for a in approaches if a not in APPROACHES]
    if unknown or not approaches:
        p.error(f"--approaches: {', '.join(unknown) or 'none given'}: choose from {', '.join(APPROACHES)}")
    if args.days < 1:
        p.error("--days: must be >= 1")
    if "warm" in approaches and not has_warm_start():
        raise SystemExit("daily_bench: (a) warm starts need `torchrec-cloud train --warm_start` (issue #42's training "
                         "half), which this checkout lacks; merge it, or run --approaches cold,frozen")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="daily-bench-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        out = Bench(args, work).run(approaches)
    print(table(out, approaches))
    for line in goals(out):
        print(line)
    if args.json:
        settings = {k: getattr(args, k) for k in ("days", "rows_per_day", "new_items", "popularity_shift", "user_churn",
                                                   "batch_size", "epochs", "learning_rate", "warm_epochs", "warm_learning_rate",
                                                   "seed")}  # fmt: skip
        print(json.dumps({**out, "settings": settings}))


if __name__ == "__main__":
    main()
