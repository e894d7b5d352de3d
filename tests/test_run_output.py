"""What a run shows where a user looks: its log read as a file (as a pod's log is), and a run
folder of its own (the same ``--output_dir`` twice never mixes two runs, while the same
command after a preemption continues its run)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, TINY, env_for_subprocess
from torchrec_cloud.metrics.run_folder import choose

STEPS = 10
COMMAND = [PYTHON, "-m", "torchrec_cloud", "train", "--synthetic", "planted",
           *[a for a in TINY if a != "--no-progress"], "--log_every", "2", "--eval_every", "4"]  # fmt: skip


def train_to_file(out: Path, log: Path, *flags: str) -> str:
    """Run the tiny trainer with stdout and stderr into ``log`` (not a terminal); its text."""
    with open(log, "w") as f:
        proc = subprocess.run([*COMMAND, "--output_dir", str(out), *flags], stdout=f, stderr=subprocess.STDOUT,
                              env=env_for_subprocess(), timeout=300)  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same --output_dir twice: with the progress bar on (the default), then off."""
    work = tmp_path_factory.mktemp("runs")
    first = train_to_file(work / "run", work / "first.log")
    second = train_to_file(work / "run", work / "second.log", "--no-progress")
    return work, first, second


@pytest.mark.parametrize("which", ["first", "second"])
def test_log_outside_a_terminal_is_plain_lines(two_runs, which):
    work, first, second = two_runs
    text = first if which == "first" else second  # --progress (default) and --no-progress read alike
    assert "\r" not in text
    lines = text.splitlines()
    assert all(len(line) <= 200 for line in lines), max(lines, key=len)
    train = [line for line in lines if line.startswith("step ")]
    # One line per --log_every steps: step of total, loss, the last val AUC once known, samples/s, ETA.
    assert [int(re.match(r"step (\d+)/10 ", line).group(1)) for line in train] == [2, 4, 6, 8, 10], train
    for line in train:
        assert re.search(r"loss \d\.\d{4} .*\d samples/s  ETA \d+s$", line), line
    assert "val AUC" not in train[0] and "val AUC 0." in train[-1]
    (plan,) = [line for line in lines if line.startswith("sharding plan")]  # one rank: one line
    assert "t_cat_0..25 (26 tables)" in plan and "ranks 0" in plan
    evals = [line for line in lines if line.startswith("[val]") or line.startswith("[test]")]
    assert len(evals) == 4  # val at 4 and 8, then val and test at the end
    assert all(re.search(r"AUC 0\.\d{4} \(Bayes-optimal 0\.\d{4}, gap -?0\.\d{4}\)", line) for line in evals), evals
    # The end: rounded figures, then where to look next.
    end = lines.index(next(line for line in lines if line.startswith("[end]")))
    assert re.match(r"\[end\] step 10 in \d+s \([\d,]+ samples/s\); test AUC 0\.\d{3} \(Bayes-optimal 0\.\d{3}\)$",
                    lines[end]), lines[end]  # fmt: skip
    folder = work / ("run" if which == "first" else "run-2")
    assert f"torchrec-cloud report {folder}" in lines[end + 1]
    assert f"tensorboard --logdir {folder}" in lines[end + 2]


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_with_the_same_output_dir_gets_a_folder_of_its_own(two_runs):
    work, _, second = two_runs
    assert second.splitlines()[0] == f"{work / 'run'} holds a finished run; this run writes to {work / 'run-2'}"
    for folder in (work / "run", work / "run-2"):
        recs = records(folder)
        assert [r["event"] for r in recs].count("start") == 1 and recs[-1]["event"] == "end"
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    assert records(work / "run-2")[0]["config"]["output"]["output_dir"] == str(work / "run-2")


CONFIG = {"model": {"embedding_dim": 8}, "checkpoint": {"checkpoint_path": "ckpt"}, "output": {"output_dir": "x"}}


def write_run(folder: Path, config: dict, ended: bool | None) -> None:
    """A run folder as the trainer leaves it: a start record, and an end record unless the
    run is still going or crashed (None); ``ended`` False: stopped for a preemption."""
    folder.mkdir(parents=True, exist_ok=True)
    recs = [{"event": "start", "step": 0, "config": config}, {"event": "train", "step": 2}]
    if ended is not None:
        recs.append({"event": "end", "step": 2, "preempted": not ended})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_which_folder_a_run_writes_to(tmp_path):
    base = tmp_path / "run"
    assert choose(str(base), CONFIG) == (base, None)  # nothing there yet
    base.mkdir()
    (base / "notes.txt").write_text("a user's file")
    assert choose(str(base), CONFIG) == (base, None)  # holds no run
    # A preempted or crashed run of the same config with checkpoints: the same command
    # again (a restarted pod) continues it, whatever the output flags.
    for ended in (False, None):
        write_run(base, {**CONFIG, "output": {"output_dir": "elsewhere"}}, ended)
        assert choose(str(base), CONFIG) == (base, None)
    # A finished run, another config, or no checkpoints to resume from: a new folder.
    write_run(base, CONFIG, True)
    assert choose(str(base), CONFIG) == (tmp_path / "run-2", f"{base} holds a finished run; this run writes to {tmp_path / 'run-2'}")
    write_run(base, {**CONFIG, "model": {"embedding_dim": 16}}, None)
    assert choose(str(base), CONFIG)[0] == tmp_path / "run-2"
    no_checkpoints = {**CONFIG, "checkpoint": {"checkpoint_path": None}}
    write_run(base, no_checkpoints, False)
    assert choose(str(base), no_checkpoints)[0] == tmp_path / "run-2"
    # The numbered folders follow the same rule: run-2 continuing is found again.
    write_run(base, CONFIG, True)
    write_run(tmp_path / "run-2", CONFIG, False)
    assert choose(str(base), CONFIG)[0] == tmp_path / "run-2"
    write_run(tmp_path / "run-2", CONFIG, True)
    assert choose(str(base), CONFIG)[0] == tmp_path / "run-3"
