"""`make quickstart` shows real learning: its default run, as the Makefile runs it, ends
close to the Bayes-optimal AUC of its planted data, with no loss spike on the way.

The one long test of the suite (about a minute on 2 cores): the quickstart preset's steps
and learning rates were chosen for this (docs/quickstart-tuning.md)."""

from __future__ import annotations

import re
import shlex

from helpers import PYTHON, REPO, explain, read_metrics, run


def quickstart_command(output_dir: str) -> list[str]:
    """The Makefile's `quickstart` recipe, with this Python and ``output_dir``."""
    lines = (REPO / "Makefile").read_text().splitlines()
    recipe = lines[lines.index("quickstart: install") + 1].strip()
    assert recipe.startswith("$(PY) -m torchrec_cloud train"), recipe
    return [PYTHON if w == "$(PY)" else w.replace("$(OUTPUT_DIR)", output_dir) for w in shlex.split(recipe)]


def test_make_quickstart_ends_near_the_bayes_optimal_auc(tmp_path):
    out = tmp_path / "quickstart"
    proc = run(quickstart_command(str(out)), timeout=900)
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(out)
    start = records[0]
    assert start["config"]["preset"] == "quickstart"
    train = [r for r in records if r["event"] == "train"]
    assert max(r["loss"] for r in train) <= 1.5, [round(r["loss"], 3) for r in train]
    val = [r for r in records if r["event"] == "eval" and r["split"] == "val"]
    (test,) = [r for r in records if r["event"] == "eval" and r["split"] == "test"]
    assert len(val) >= 3 and val[0]["auc"] < val[-1]["auc"]  # the curve a user watches rises
    assert start["bayes_auc"] - val[-1]["auc"] <= 0.03, (start["bayes_auc"], val[-1]["auc"])
    assert test["bayes_auc"] - test["auc"] <= 0.03, test
    # Each evaluation says how far it is from the best possible.
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[val]")]
    assert len(printed) == len(val)
    for line, r in zip(printed, val):
        gap = float(re.search(r"gap (-?\d\.\d{4})", line).group(1))
        assert abs(gap - (r["bayes_auc"] - r["auc"])) < 1e-4, line
