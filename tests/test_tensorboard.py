"""TensorBoard's own reader finds the scalars a real training run wrote, with the logged values."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tensorboard_reads_back_the_run(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable, "-m", "torchrec_cloud", "train", "--synthetic", "planted",
            "--num_embeddings", "1000", "--embedding_dim", "16",
            "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1",
            "--batch_size", "256", "--num_batches_per_epoch", "60", "--log_every", "10",
            "--eval_every", "30", "--num_eval_batches", "2", "--no-progress",
            "--output_dir", str(out),
        ],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert r.returncode == 0, r.stderr[-3000:]

    acc = EventAccumulator(str(out), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    expected = {
        "train/loss": [x for x in records if x.get("event") == "train"],
        "train/samples_per_s": [x for x in records if x.get("event") == "train"],
        "train/lr": [x for x in records if x.get("event") == "train"],
        "val/auc": [x for x in records if x.get("event") == "eval" and x.get("split") == "val"],
        "val/logloss": [x for x in records if x.get("event") == "eval" and x.get("split") == "val"],
        "test/auc": [x for x in records if x.get("event") == "eval" and x.get("split") == "test"],
    }
    assert set(expected) <= tags, f"missing: {set(expected) - tags}"
    for tag, recs in expected.items():
        key = tag.split("/")[1]
        want = [(x["step"], x[key]) for x in recs if x.get(key) is not None]
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        for (_, g), (_, w) in zip(got, want):
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-9), (tag, g, w)  # stored as float32
    assert len(acc.Scalars("val/auc")) == 2  # steps 30 and 60
    assert all(0.5 < e.value <= 1.0 for e in acc.Scalars("test/auc"))
