"""TensorBoard's own reader finds the scalars a real training run wrote, with the logged values."""

from __future__ import annotations

import math

from observed_run import observed_run


def test_tensorboard_reads_back_the_run(tmp_path_factory) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = observed_run(tmp_path_factory)
    acc = EventAccumulator(str(run.output_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    train = [x for x in run.records if x.get("event") == "train"]
    val = [x for x in run.records if x.get("event") == "eval" and x.get("split") == "val"]
    test = [x for x in run.records if x.get("event") == "eval" and x.get("split") == "test"]
    expected = {
        "train/loss": train,
        "train/samples_per_s": train,
        "train/lr": train,
        "val/auc": val,
        "val/logloss": val,
        "test/auc": test,
        "test/logloss": test,
    }
    assert set(expected) <= tags, f"missing: {set(expected) - tags}"
    for tag, recs in expected.items():
        key = tag.split("/")[1]
        want = [(x["step"], x[key]) for x in recs if x.get(key) is not None]
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        for (_, g), (_, w) in zip(got, want):
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-9), (tag, g, w)  # stored as float32
    assert [e.step for e in acc.Scalars("val/auc")] == [40, 80]
    assert all(0.0 <= e.value <= 1.0 for e in acc.Scalars("test/auc"))
    # TensorBoard lists groups alphabetically: train, val and test are the only ones, and
    # each value is there once (a train record's logloss is its loss).
    assert {tag.split("/")[0] for tag in tags} == {"train", "val", "test"}, tags
    assert "train/logloss" not in tags and "val/loss" not in tags
    # The best possible AUC of the planted data, beside the model's at each evaluation.
    bayes = [(e.step, e.value) for e in acc.Scalars("val/bayes_auc")]
    assert [s for s, _ in bayes] == [40, 80]
    assert all(math.isclose(v, run.records[0]["bayes_auc"], rel_tol=1e-6) for _, v in bayes)
    # The Custom Scalars tab overlays them on one chart.
    assert acc.Tags().get("tensors") and any("custom_scalars" in t for t in acc.Tags()["tensors"])
