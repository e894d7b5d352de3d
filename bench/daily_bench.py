"""Seven days of a drifting world, trained three ways (issue #42): next-day test AUC and
samples trained per day.

The world: data/events_gen.py with ``Drift`` (new items each day at the top of the popularity
ranking, the older ones' ranking rotating, users churning), so yesterday's model meets ids it
never saw. Day d's rows train (80%) and validate (10%, by a hash of each row); every row of day
d + 1 is day d's next-day test, scored with ``predict --input`` through the model's own
transforms (an id it never saw goes to row 0), whose Bayes-optimal AUC is known.

- (a) ``warm``: day d is preprocessed with ``--vocab_from`` day d-1's dataset (ids keep their
  rows) and trained with ``train --warm_start`` day d-1's checkpoint on day d's rows only,
  ``--warm_epochs`` (2) times over them where (b) reads its rows ``--epochs`` (3) times;
  day 0 is (b)'s day 0.
- (b) ``cold``: a model trained from scratch on days 0..d every day (its own vocabulary).
- (c) ``frozen``: day 0's model, never trained again.

Samples trained per day: the training split's rows times ``--epochs`` (what each day's run
reads). The issue's goals: (a) within 0.002 of (b) every day, at no more than 1/3 of (b)'s
samples by day 7, and above (c) from day 2; the last lines say which hold.

The protocol (fixed before the runs it judges): one run of the seven days differs from
the next by about the goal's 0.002 (RESULTS.md, #42), so ``--seeds K`` repeats the whole week
K times, replicate s drawing its own world (``events_gen`` seed s: its users', items' and tags'
weights, its rows) and its own training (``train --seed s``: initialisation and shuffling, the
same seed for the three approaches). A new world per replicate, not only a new training seed,
because the goal is about the method on a drifting world, not about one world's seven days;
the training seed alone would leave the world's own luck (which items arrive, which users
churn) in every replicate. The three approaches of one replicate meet the same test rows, so
each day's comparison is paired: per day, the mean over replicates of (a) - (b) and of (a) - (c)
with its standard error (the replicates' standard deviation / sqrt(K)). The goals are judged on
those means: "within 0.002" holds on a day if the mean of (a) - (b) is >= -0.002; the verdict
says "clearly" when that stays true (or false) 2 standard errors either way, and "undecided
at K replicates" otherwise. Nothing here is chosen by looking at a test day's AUC: a change to
(a)'s training (epochs, rates) runs as ``--variant NAME`` beside a full run's replicates (the
same worlds, rows, splits and day-0 model) and is judged on each day's own validation rows
(the 10% held out of day d, which a daily job has; ``val_auc``): it is kept only if the mean
over replicates of its (variant - (a)) validation AUC, averaged over days 1.., is above 0 by 2
standard errors. Its next-day figures are printed too, but they decide nothing.

(a) needs ``train --warm_start`` (the training half of issue #42): without it the script stops
at once, saying so, unless ``--approaches cold,frozen``. Quality figures are not timings
(seeds fixed), but each day trains once per approach: about 30 runs of a small model per
replicate::

    python bench/daily_bench.py --seeds 4 --work /tmp/daily --json
    python bench/daily_bench.py --seeds 4 --work /tmp/daily --approaches warm --variant lr015 --warm_learning_rate 0.015
    python bench/daily_bench.py --json
    python bench/daily_bench.py --approaches cold,frozen --json
    python bench/daily_bench.py --days 3 --rows_per_day 5000 --work /tmp/daily     # a quick look, kept

The last line with --json is one JSON object: per approach and day, the AUC and samples
(the mean over replicates), and ``replicates``: each replicate's own. With ``--work``, each
replicate's figures are kept in ``DIR/seed_S/result.json`` and a later run with the same
settings takes them instead of training again (so the replicates can run one sitting at a time).
Replicates run elsewhere (other ``--work`` folders, at the same time or on other machines) are
taken with ``--from DIR`` (repeatable), each approach's figures from a kept result of the same
settings ((b) and (c) do not depend on (a)'s ``--warm_*`` settings, so a variant's
``result_NAME.json`` pairs with its folder's ``result.json``); ``--seeds`` also takes a list::

    python bench/daily_bench.py --seeds 0-9,11-12 --work /tmp/all --from /tmp/daily_a --from /tmp/daily_b --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    def __init__(self, args: argparse.Namespace, work: Path, seed: int) -> None:
        self.args, self.work, self.seed = args, work, seed
        (work / "schema.yaml").write_text(SCHEMA)
        drift = events_gen.Drift(new_items=args.new_items, popularity_shift=args.popularity_shift, user_churn=args.user_churn)
        self.events = events_gen.write_events(str(work / "events"), days=args.days + 1, rows_per_day=args.rows_per_day,
                                              seed=seed, drift=drift)  # fmt: skip
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
                "--no-tensorboard", "--seed", str(self.seed), "--checkpoint_path", str(day.ck), "--output_dir", str(day.run)]  # fmt: skip
        if warm_start is not None:
            argv += ["--warm_start", str(warm_start.ck)]
        command(*argv)
        command("export", str(day.ck), "--output", str(day.model))
        return self.samples(day, epochs)

    @staticmethod
    def samples(day: Day, epochs: int) -> int:
        manifest = json.loads((day.data / "manifest.json").read_text())
        return epochs * sum(end - start for _, start, end in manifest["splits"]["train"])

    @staticmethod
    def val_auc(day: Day) -> float:
        """AUC of ``day``'s model on its own day's validation rows (the last eval the run logged)."""
        records = [json.loads(line) for line in (day.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [r for r in records if r.get("event") == "eval" and r.get("split") == "val"][-1]["auc"]

    def next_day_auc(self, day: Day, d: int) -> float:
        """AUC of ``day``'s model on every row of day d + 1."""
        scores = day.folder / f"scores_{d + 1}.csv"
        out = command("predict", str(day.model), "--input", self.files[d + 1], "--output", str(scores), "--json", "--no_progress")
        return json.loads(out.strip().splitlines()[-1])["auc"]

    def run(self, approaches: list[str]) -> dict:
        days = self.args.days
        # (c) never trains after day 0, so it has no validation figure of day d.
        out = {a: {"auc": [], "samples": [], **({} if a == "frozen" else {"val_auc": []})} for a in approaches}
        cold = [Day(self.work / "cold" / f"day_{d}") for d in range(days)]
        warm_folder = self.work / ("warm" if self.args.variant is None else f"warm_{self.args.variant}")
        warm = [cold[0]] + [Day(warm_folder / f"day_{d}") for d in range(1, days)]
        day0_samples = None
        for d in range(days):
            if d == 0 and "cold" not in approaches and (cold[0].model / "model_config.json").exists():
                day0_samples = self.samples(cold[0], self.args.epochs)  # a full run's day 0, kept in --work
            elif "cold" in approaches or d == 0:
                self.preprocess(cold[d], self.files[: d + 1])
                samples = self.train(cold[d])
                day0_samples = samples if d == 0 else day0_samples
                if "cold" in approaches:
                    out["cold"]["auc"].append(self.next_day_auc(cold[d], d))
                    out["cold"]["val_auc"].append(self.val_auc(cold[d]))
                    out["cold"]["samples"].append(samples)
            if "warm" in approaches:
                if d == 0:
                    samples = day0_samples
                else:
                    self.preprocess(warm[d], [self.files[d]], vocab_from=warm[d - 1])
                    samples = self.train(warm[d], warm_start=warm[d - 1])
                out["warm"]["auc"].append(self.next_day_auc(warm[d], d))
                out["warm"]["val_auc"].append(self.val_auc(warm[d]))
                out["warm"]["samples"].append(samples)
            if "frozen" in approaches:
                out["frozen"]["auc"].append(self.next_day_auc(cold[0], d))
                out["frozen"]["samples"].append(day0_samples if d == 0 else 0)
            print(f"seed {self.seed} day {d}: " + ", ".join(f"{a} {out[a]['auc'][-1]:.4f}" for a in approaches), file=sys.stderr, flush=True)
        out["bayes_auc_next_day"] = self.events["bayes_auc_by_day"][1 : days + 1]
        return out


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (0 for one value: nothing to say about the spread)."""
    k = len(values)
    mean = sum(values) / k
    if k < 2:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (k - 1) / k) ** 0.5


def combine(replicates: list[dict], approaches: list[str]) -> dict:
    """Per approach and day, the mean over replicates of the AUC, validation AUC and samples;
    per day, the paired differences (a) - (b) and (a) - (c) as [mean, standard error]."""
    days = len(replicates[0]["bayes_auc_next_day"])
    out: dict = {"replicates": replicates, "seeds": [r["seed"] for r in replicates]}
    for a in approaches:
        out[a] = {key: [mean_se([r[a][key][d] for r in replicates])[0] for d in range(days)]
                  for key in replicates[0][a]}  # fmt: skip
    out["bayes_auc_next_day"] = [mean_se([r["bayes_auc_next_day"][d] for r in replicates])[0] for d in range(days)]
    for name, other in (("warm_minus_cold", "cold"), ("warm_minus_frozen", "frozen")):
        if "warm" in approaches and other in approaches:
            out[name] = [list(mean_se([r["warm"]["auc"][d] - r[other]["auc"][d] for r in replicates])) for d in range(days)]
            if days > 1:  # days 1..: each replicate's mean over its days, then over replicates
                out[f"{name}_days_1_on"] = list(mean_se([sum(r["warm"]["auc"][d] - r[other]["auc"][d] for d in range(1, days))
                                                         / (days - 1) for r in replicates]))  # fmt: skip
    return out


def goals(out: dict) -> list[str]:
    """The issue's three goals, judged on the means over replicates (the module's protocol)."""
    if not all(a in out for a in APPROACHES):
        return ["goals: need all three approaches"]
    k = len(out["seeds"])

    def verdict(holds: bool, low: float, high: float, line: float) -> str:
        if k < 2:
            return "yes" if holds else "no"
        clear = low >= line or high < line
        return f"{'yes' if holds else 'no'}{', clearly' if clear else f', undecided at {k} replicates'}"

    days = []
    for d, (m, se) in enumerate(out["warm_minus_cold"]):
        days.append(f"day {d} {m:+.4f}" + (f" +- {se:.4f} ({verdict(m >= -0.002, m - 2 * se, m + 2 * se, -0.002)})" if k > 1 else ""))
    worst = min(m for m, _ in out["warm_minus_cold"])
    ratio = out["warm"]["samples"][-1] / out["cold"]["samples"][-1]
    later = out["warm_minus_frozen"][2:]
    above = all(m > 0 for m, _ in later)
    low, high = min((m - 2 * se for m, se in later), default=0.0), max((m + 2 * se for m, se in later), default=0.0)
    return [f"(a) within 0.002 of (b) every day: {'yes' if worst >= -0.002 else 'no'} (mean (a) - (b) over {k} "
            f"replicate{'s' * (k > 1)}: {'; '.join(days)})",
            *([f"(a) - (b) over days 1..{len(days) - 1}: {out['warm_minus_cold_days_1_on'][0]:+.4f} +- "
               f"{out['warm_minus_cold_days_1_on'][1]:.4f} (a summary; the goal is per day)"]
              if "warm_minus_cold_days_1_on" in out else []),
            f"(a)'s samples on the last day <= 1/3 of (b)'s: {'yes' if ratio <= 1 / 3 else 'no'} ({ratio:.3f})",
            f"(a) above (c) from day 2: {verdict(above, low, high, 0.0) if later else 'no day 2 to judge'}"]  # fmt: skip


def table(out: dict, approaches: list[str]) -> str:
    diffs = [n for n in ("warm_minus_cold", "warm_minus_frozen") if n in out]
    head = ("| day | next-day Bayes AUC | " + " | ".join(f"{a} AUC" for a in approaches) + "".join(
        f" | {n.replace('_minus_', ' - ')}" for n in diffs) + " | " + " | ".join(f"{a} samples" for a in approaches) + " |")  # fmt: skip
    lines = [head, "| " + " | ".join(["---"] + ["---:"] * (1 + len(diffs) + 2 * len(approaches))) + " |"]
    for d, bayes in enumerate(out["bayes_auc_next_day"]):
        lines.append(f"| {d} | {bayes:.4f} | " + " | ".join(f"{out[a]['auc'][d]:.4f}" for a in approaches)
                     + "".join(f" | {out[n][d][0]:+.4f} +- {out[n][d][1]:.4f}" for n in diffs) + " | "
                     + " | ".join(f"{round(out[a]['samples'][d]):,}" for a in approaches) + " |")  # fmt: skip
    return "\n".join(lines)


def against_base(replicates: list[dict], work: Path) -> dict | None:
    """A ``--variant``'s (a) against the full run's (a) kept under the same ``--work``, paired
    by replicate: per day, [mean, standard error] of (variant - base) on the day's validation
    rows (``val_auc``) and on the next day's rows (``auc``); ``val_mean``: the validation
    difference averaged over days 1.. in each replicate, then over replicates (the rule
    in the module's docstring keeps a variant only when it is above 0 by 2 standard errors)."""
    pairs, whole = [], []
    for r in replicates:
        kept = work / f"seed_{r['seed']}" / "result.json"
        if kept.exists():
            base = json.loads(kept.read_text())
            pairs.append((r["warm"], base["warm"]))
            if all(a in base for a in APPROACHES):
                whole.append({**base, "seed": r["seed"], "warm": r["warm"]})
    if not pairs:
        return None
    days = range(1, len(pairs[0][0]["auc"]))
    out: dict = {"replicates": len(pairs)}
    for key in ("val_auc", "auc"):
        out[key] = {d: list(mean_se([v[key][d] - b[key][d] for v, b in pairs])) for d in days}
    out["val_mean"] = list(mean_se([sum(v["val_auc"][d] - b["val_auc"][d] for d in days) / len(days) for v, b in pairs]))
    out["auc_mean"] = list(mean_se([sum(v["auc"][d] - b["auc"][d] for d in days) / len(days) for v, b in pairs]))
    # The goals with the variant as (a), against the same replicates' (b) and (c).
    out["as_warm"] = combine(whole, list(APPROACHES)) if len(whole) == len(replicates) else None
    return out


def same_settings(a: dict, b: dict) -> bool:
    """Whether two runs' settings train alike (an unset warm epoch count or rate is the cold one's)."""

    def plain(s: dict) -> dict:
        return {**s, "warm_epochs": s.get("warm_epochs") or s.get("epochs"),
                "warm_learning_rate": s.get("warm_learning_rate") or s.get("learning_rate")}  # fmt: skip

    return plain(a) == plain(b)


WARM_SETTINGS = ("warm_epochs", "warm_learning_rate")


def kept_elsewhere(folder: Path, seed: int, approaches: list[str], settings: dict) -> dict | None:
    """Seed ``seed``'s figures from the results kept in ``folder`` by runs of the same
    settings ((a) from a result whose ``--warm_*`` settings are these too; (b) and (c) from any),
    or None when an approach has none."""
    results = [json.loads(f.read_text()) for f in sorted(folder.glob("result*.json"))]
    out: dict = {"seed": seed}
    for a in approaches:
        ignored = {} if a == "warm" else dict.fromkeys(WARM_SETTINGS)  # (b) and (c) train alike whatever (a)'s are
        for r in results:
            if a not in r or not same_settings({**r.get("settings", {}), **ignored}, {**settings, **ignored}):
                continue
            out[a], out["bayes_auc_next_day"] = r[a], r["bayes_auc_next_day"]
            break
        else:
            return None
    return out


def replicate(args: argparse.Namespace, approaches: list[str], work: Path, seed: int, settings: dict) -> dict:
    """One week of seed ``seed`` under ``work``; taken from ``work/result.json`` when a run with
    the same settings left it there, or from a ``--from`` folder's."""
    kept = work / ("result.json" if args.variant is None else f"result_{args.variant}.json")
    if kept.exists():
        old = json.loads(kept.read_text())
        if same_settings(old.get("settings", {}), settings) and all(a in old for a in approaches):
            print(f"seed {seed}: taken from {kept}", file=sys.stderr, flush=True)
            return {"seed": seed, "bayes_auc_next_day": old["bayes_auc_next_day"], **{a: old[a] for a in approaches}}
    for folder in args.from_:
        taken = kept_elsewhere(Path(folder) / f"seed_{seed}", seed, approaches, settings)
        if taken is not None:
            print(f"seed {seed}: taken from {folder}", file=sys.stderr, flush=True)
            return taken
    work.mkdir(parents=True, exist_ok=True)
    out = Bench(args, work, seed).run(approaches)
    kept.write_text(json.dumps({**out, "settings": settings}))
    return {"seed": seed, **out}


def seed_list(first: int, text: str) -> list[int]:
    """``K`` (seeds first .. first + K - 1) or a list of seeds and ranges, ``0-9,11``."""
    if re.fullmatch(r"\d+", text):
        if int(text) < 1:
            raise ValueError("must be >= 1")
        return list(range(first, first + int(text)))
    seeds: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"expected K or a list like 0-9,11, got {text!r}")
        seeds += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"a seed twice in {text!r}")
    return seeds


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
    p.add_argument("--warm_epochs", type=int, default=2,
                   help="(a)'s epochs over each day (0: --epochs); 2 was kept on validation (RESULTS.md, #42)")
    p.add_argument("--warm_learning_rate", type=float, default=None, help="(a)'s learning rate (default: --learning_rate)")
    p.add_argument("--variant", default=None, metavar="NAME",
                   help="(a)'s runs go to DIR/seed_S/warm_NAME, beside a full run's under the same --work, whose "
                        "day 0 (b) they start from: a change to (a) compared on the same worlds, rows and splits")
    p.add_argument("--seed", type=int, default=0, help="the first replicate's seed (world and training)")
    p.add_argument("--seeds", default="1", metavar="K|LIST",
                   help="replicates: seeds SEED .. SEED+K-1, or a list (0-9,11), each its own world and training "
                        "(the module's protocol)")
    p.add_argument("--from", dest="from_", action="append", default=[], metavar="DIR",
                   help="take replicates kept under another --work folder (DIR/seed_S) with the same settings")
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
    try:
        seeds = seed_list(args.seed, args.seeds)
    except ValueError as e:
        p.error(f"--seeds: {e}")
    if "warm" in approaches and not has_warm_start():
        raise SystemExit("daily_bench: (a) warm starts need `torchrec-cloud train --warm_start` (issue #42's training "
                         "half), which this checkout lacks; merge it, or run --approaches cold,frozen")  # fmt: skip
    settings = {k: getattr(args, k) for k in ("days", "rows_per_day", "new_items", "popularity_shift", "user_churn",
                                               "batch_size", "epochs", "learning_rate", "warm_epochs", "warm_learning_rate")}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="daily-bench-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        replicates = [replicate(args, approaches, work / f"seed_{s}", s, settings) for s in seeds]
    out = combine(replicates, approaches)
    print(table(out, approaches))
    for line in goals(out):
        print(line)
    if args.variant is not None and "warm" in approaches and args.work:
        base = against_base(replicates, Path(args.work))
        if base is not None:
            out["variant_minus_base"] = base
            for key, name in (("val_auc", "its day's validation rows"), ("auc", "the next day's rows")):
                print(f"variant {args.variant} - (a) on {name}, over {base['replicates']} replicates: " + "; ".join(
                    f"day {d} {m:+.4f} +- {se:.4f}" for d, (m, se) in base[key].items()))  # fmt: skip
            m, se = base["val_mean"]
            print(f"variant {args.variant} - (a), validation, days 1..{args.days - 1}: {m:+.4f} +- {se:.4f}: "
                  f"{'kept' if m > 2 * se else 'not kept'} (kept only above 0 by 2 standard errors)")  # fmt: skip
            if base["as_warm"] is not None:
                print(f"with variant {args.variant} as (a), against the same replicates' (b) and (c):")
                print(table(base["as_warm"], list(APPROACHES)))
                for line in goals(base["as_warm"]):
                    print(line)
                base["as_warm"] = {k: v for k, v in base["as_warm"].items() if k != "replicates"}
    if args.json:
        print(json.dumps({**out, "settings": {**settings, "seeds": seeds}}))


if __name__ == "__main__":
    main()
