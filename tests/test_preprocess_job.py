"""Preprocessing bigger than one machine: `render --job preprocess` for 2 shares over Parquet
and CSV events, rehearsed as the Indexed Job's pods with pod 1 killed after its first shard.

The job must complete, the killed share retried, and the dataset be the one a single
machine's `data preprocess` writes of the same inputs: the same manifest (rows, splits,
vocabularies, dense statistics, shard checksums) and the same bytes in every shard.
The pod is killed while it waits after committing that shard (the test-only hold in
data/preprocess.py), so it is lost mid-way whatever the machine's speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env_for_subprocess
from torchrec_cloud.cli import main
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, generate, write_csv, write_events
from torchrec_cloud.data.preprocess import TEST_HOLD_ENV
from torchrec_cloud.deploy.manifests import load_documents

ROWS_PER_DAY = 600
SPLIT = ["--split_by", "ts", "--val_from", str(START + 2 * DAY_S), "--test_from", str(START + 3 * DAY_S)]


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preprocess-job")
    events = root / "events"
    write_events(str(events), days=4, rows_per_day=ROWS_PER_DAY, seed=1)  # day_0..3.parquet
    write_csv(str(events / "day_4.csv"), generate(ROWS_PER_DAY, 4, 1))
    (root / "schema.yaml").write_text(SCHEMA)
    flags = ["--schema", str(root / "schema.yaml"), "--input", str(events), "--rows_per_shard", "250",
             "--workers", "1", "--no_progress", *SPLIT]  # fmt: skip
    assert main(["data", "preprocess", *flags, "--output", str(root / "whole")]) == 0
    job = ["--job", "preprocess", "--nodes", "2"]
    assert main(["render", *job, "--output", str(root / "rendered"), "--", *flags, "--output", str(root / "shards")]) == 0
    # Share 1 holds inputs 1 and 3; it is killed after committing the first shard of input 1.
    cmd = [sys.executable, "-m", "torchrec_cloud", "rehearse", *job, "--kill", "1@1", "--output", str(root / "rehearsal"),
           "--delay_scale", "0.01", "--timeout", "300", "--json", "--", *flags, "--output", str(root / "shards")]  # fmt: skip
    env = {**env_for_subprocess(), TEST_HOLD_ENV: "00001-day_1-00000.bin"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {"root": root, "report": json.loads(lines[-1]), "rc": proc.returncode, "log": proc.stdout}


def test_the_job_completes_with_the_killed_share_retried(rehearsed):
    report = rehearsed["report"]
    assert rehearsed["rc"] == 0 and report["completed"] and report["outcome"] == "complete", rehearsed["log"][-3000:]
    assert [f["fired"] for f in report["faults"]] == [True], report["faults"]
    assert [p["exit_codes"] for p in report["pods"]] == [[0], [137, 0]], report["pods"]
    assert "pod 1: failure 1 counted; replaced" in rehearsed["log"]  # backoffLimitPerIndex: this index only
    logs = [Path(p).read_text() for p in report["pods"][1]["logs"]]
    assert "share 1 of 2: converted 2 inputs" in logs[1] or "wrote " in logs[1], logs


def test_the_dataset_equals_one_machines(rehearsed):
    root = rehearsed["root"]
    whole = json.loads((root / "whole" / "manifest.json").read_text())
    shared = json.loads((root / "shards" / "manifest.json").read_text())
    assert shared == whole  # rows, splits, vocabularies, statistics, every shard's checksum
    assert rehearsed["report"]["final"] == {"rows": 5 * ROWS_PER_DAY, "shards": len(whole["shards"])}
    assert len({s["source"] for s in whole["shards"]}) == 5
    for entry in [*whole["shards"], *whole["transforms"]["vocab"].values()]:
        assert (root / "shards" / entry["path"]).read_bytes() == (root / "whole" / entry["path"]).read_bytes()
    assert main(["data", "verify", str(root / "shards")]) == 0


def test_the_rehearsal_ran_the_rendered_job(rehearsed):
    """The pods ran the Indexed Job that `render --job preprocess` writes for the same flags."""
    root = rehearsed["root"]
    rendered = load_documents((root / "rendered" / "preprocess.yaml").read_text())
    rehearsed_docs = load_documents((root / "rehearsal" / "manifests.yaml").read_text())
    assert rehearsed_docs == rendered
    (job,) = [d for d in rendered if d["kind"] == "Job"]
    assert job["spec"]["completions"] == 2 and "--shares" in job["spec"]["template"]["spec"]["containers"][0]["args"]
