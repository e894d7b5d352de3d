"""Checkpoints on one rank, in this process: round trips to local disk and to the S3, GCS
and Azure emulators, async saves, damaged or uncommitted checkpoints, the ``checkpoint``
command, and clear start-up errors for bad paths."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from checkpoint_runs import TINY, free_port, metrics
from services import AZURITE_ACCOUNT
from torchrec_cloud import checkpoint, cli
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.train import run as train

SHORT = ["--num_batches_per_epoch", "6", "--checkpoint_interval", "3"]


def config(out: Path, *flags: str):
    return parse_job_config([*TINY, "--output_dir", str(out), *flags])


def records(out: Path, event: str) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def model_state(path: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in checkpoint.load_full_state(path).items() if not k.startswith("rng.")}


def scores(result: dict) -> dict:
    return {split: (result[split]["auc"], result[split]["logloss"]) for split in ("val", "test")}


def cli_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """6 steps on local disk, a checkpoint every 3 steps, all kept."""
    out = tmp_path_factory.mktemp("sync")
    root = out / "ckpt"
    result = train(config(out, *SHORT, "--checkpoint_path", str(root), "--checkpoint_keep", "0"))
    return out, root, result


def test_round_trip(storage_root, tmp_path, capsys):
    flags = [*SHORT, "--checkpoint_path", storage_root, "--checkpoint_keep", "1"]
    first = train(config(tmp_path / "a", *flags))
    saved = records(tmp_path / "a", "checkpoint")
    assert [r["step"] for r in saved] == [3, 6]
    assert all(r["bytes"] > 26 * 1000 * 16 * 4 and r["seconds"] > 0 for r in saved)  # tables alone

    listed = checkpoint.list_checkpoints(storage_root)  # keep 1: step 3 was deleted
    assert [(i.name, i.complete, i.world_size, i.bytes) for i in listed] == [
        ("step_00000006", True, 1, saved[-1]["bytes"])
    ]
    verified = checkpoint.verify_checkpoint(listed[0].path)  # checksums taken as each file was uploaded
    assert verified.complete and set(verified.checksums["files"]) == {".metadata", "__0_0.distcp"}
    state = model_state(listed[0].path)
    tables = [k for k in state if k.endswith(".weight") and "embedding_bags" in k]
    assert len(tables) == 26 and all(state[k].shape == (1000, 16) for k in tables)
    assert sum(k.endswith("momentum1") for k in state) == 26  # fused row-wise Adagrad
    assert any(k.endswith(".sum") for k in state)  # dense Adagrad

    # The same command again resumes (already finished: evaluates only) to the same metrics.
    again = train(config(tmp_path / "b", *flags))
    (resumed,) = records(tmp_path / "b", "resume")
    assert resumed["step"] == 6 and resumed["path"] == listed[0].path
    assert scores(again) == scores(first)

    code, out, _ = cli_main(capsys, "checkpoint", "ls", storage_root)
    assert code == 0 and "step_00000006" in out and "complete" in out


def test_async_save_commits_the_same_checkpoint(sync_run, tmp_path, capsys):
    _, sync_root, sync_result = sync_run
    root = tmp_path / "ckpt"
    result = train(config(tmp_path, *SHORT, "--checkpoint_path", str(root), "--checkpoint_keep", "0", "--async_checkpoint"))
    saved = records(tmp_path, "checkpoint")
    assert [(r["step"], r["async"]) for r in saved] == [(3, True), (6, True)]
    assert all(r["stall_s"] <= r["seconds"] for r in saved)
    assert [i.step for i in checkpoint.list_checkpoints(str(root)) if i.complete] == [3, 6]
    for name in ("step_00000003", "step_00000006"):
        assert checkpoint.verify_checkpoint(str(root / name)).checksums is not None  # from the background write
        expected, actual = model_state(str(sync_root / name)), model_state(str(root / name))
        assert sorted(expected) == sorted(actual)
        assert all(torch.equal(expected[k], actual[k]) for k in expected), name
    assert scores(result) == scores(sync_result)

    # What users have at hand: the run folder, or the folder of checkpoints.
    capsys.readouterr()
    code, out, _ = cli_main(capsys, "checkpoint", "ls", str(tmp_path))
    assert code == 0 and "step_00000003" in out and "step_00000006" in out, out
    code, out, err = cli_main(capsys, "checkpoint", "inspect", str(root))
    assert code == 0 and "step_00000006" in out and "inspecting the newest complete one" in err, err


def test_checkpoints_on_a_clock_end_their_segment_and_resume_exactly(sync_run, tmp_path):
    """--checkpoint_every_s: every rank ends the step in progress when the clock says so
    (here after every step: the clock is always due), saves, and goes on; the cuts change
    nothing trained, and a resume from a checkpoint in mid-segment finishes the same."""
    _, _, sync_result = sync_run
    root = tmp_path / "ckpt"
    flags = ["--num_batches_per_epoch", "6", "--checkpoint_path", str(root), "--checkpoint_keep", "0"]
    result = train(config(tmp_path / "clock", *flags, "--checkpoint_every_s", "1e-9"))
    saved = records(tmp_path / "clock", "checkpoint")
    assert [r["step"] for r in saved] == [1, 2, 3, 4, 5, 6]
    assert scores(result) == scores(sync_result)  # sync_run: the same 6 steps in 2 segments
    commit = checkpoint.inspect_checkpoint(str(root / "step_00000004")).commit
    assert (commit["trainer"]["epoch"], commit["trainer"]["batch"]) == (0, 4)
    resumed = train(config(tmp_path / "resumed", "--num_batches_per_epoch", "6", "--resume_from",
                           str(root / "step_00000004")))  # fmt: skip
    assert records(tmp_path / "resumed", "resume")[0]["step"] == 4
    assert scores(resumed) == scores(sync_result)
    # Every start is listed beside the checkpoints: the step it resumed from.
    lines = (root / "attempts.jsonl").read_text().splitlines()
    assert [json.loads(line)["resumed_from"] for line in lines] == [0]


def test_waiting_for_a_slow_background_save_is_that_saves_stall(tmp_path, monkeypatch):
    """Training that waits at step 6 for step 3's save still being written was stalled by
    step 3's save: its record says so, and step 6's own stall is only its own. Step 3's save
    ends ``delay`` seconds after training starts waiting for it, however fast steps 4-6 ran."""
    import torch.distributed.checkpoint as dcp

    original, delay, calls = dcp.async_save, 4.0, []
    waited = threading.Event()

    class WaitedFor(Future):
        def result(self, timeout=None):  # training blocks on the save here (Checkpointer.wait)
            waited.set()
            return super().result(timeout)

    def first_one_slow(*args, **kwargs):
        future = original(*args, **kwargs)
        calls.append(future)
        if len(calls) > 1:
            return future
        slow = WaitedFor()

        def finish_late() -> None:  # a failed save fails the late future too, instead of a hang
            try:
                future.result()
                waited.wait()
                time.sleep(delay)
                slow.set_result(None)
            except BaseException as e:
                slow.set_exception(e)

        threading.Thread(target=finish_late, daemon=True).start()
        return slow

    monkeypatch.setattr(dcp, "async_save", first_one_slow)
    flags = [*SHORT, "--checkpoint_path", str(tmp_path / "ckpt"), "--async_checkpoint"]
    train(config(tmp_path, *flags))
    third, sixth = records(tmp_path, "checkpoint")
    assert (third["step"], sixth["step"]) == (3, 6)
    assert delay <= third["stall_s"] <= third["seconds"]
    assert sixth["stall_s"] <= sixth["seconds"] and sixth["stall_s"] < third["stall_s"]


def test_damaged_or_uncommitted_checkpoint_is_skipped(sync_run, tmp_path, capsys):
    _, sync_root, sync_result = sync_run
    root = tmp_path / "ckpt"
    shutil.copytree(sync_root, root)
    shard = root / "step_00000006" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # a copy cut short

    with pytest.warns(checkpoint.CheckpointWarning, match=r"step_00000006.*truncated.*using .*step_00000003"):
        result = train(config(tmp_path / "out", *SHORT, "--checkpoint_path", str(root), "--checkpoint_keep", "0"))
    (resumed,) = records(tmp_path / "out", "resume")
    assert resumed["step"] == 3 and resumed["path"].endswith("step_00000003")
    assert scores(result) == scores(sync_result)  # trained 3 -> 6 again, to the same result
    assert checkpoint.inspect_checkpoint(str(root / "step_00000006")).complete  # rewritten whole

    (root / "step_00000006" / checkpoint.COMMIT_FILE).unlink()  # a save that never committed
    with pytest.warns(checkpoint.CheckpointWarning, match=r"step_00000006: no COMMIT.json.*using .*step_00000003"):
        assert checkpoint.newest_complete(str(root)).step == 3
    code, out, _ = cli_main(capsys, "checkpoint", "ls", str(root))
    assert code == 0 and "INCOMPLETE: no COMMIT.json" in out
    code, out, _ = cli_main(capsys, "checkpoint", "inspect", str(root / "step_00000003"))
    assert code == 0 and "status      complete" in out and "world_size  1" in out
    assert "model" in out and "optimizer" in out  # the tensor groups it holds
    code, out, _ = cli_main(capsys, "checkpoint", "inspect", str(root / "step_00000006"))
    assert code == 1 and "INCOMPLETE" in out


def test_resume_from_an_older_checkpoint_warns_about_newer_ones(sync_run, tmp_path):
    _, sync_root, sync_result = sync_run
    root = tmp_path / "ckpt"
    shutil.copytree(sync_root, root)
    older = root / "step_00000003"
    flags = [*SHORT, "--checkpoint_path", str(root), "--checkpoint_keep", "0", "--resume_from", str(older)]
    with pytest.warns(checkpoint.CheckpointWarning, match=r"already holds step_00000006, newer than --resume_from"):
        result = train(config(tmp_path / "out", *flags))
    (resumed,) = records(tmp_path / "out", "resume")
    assert resumed["step"] == 3 and resumed["path"] == str(older)
    assert scores(result) == scores(sync_result)


def test_resume_from_a_path_that_is_not_a_checkpoint_fails_before_training(tmp_path, capsys):
    bogus = tmp_path / "not-a-checkpoint"
    bogus.mkdir()
    (bogus / "notes.txt").write_text("hello")
    out = tmp_path / "out"
    code, _, err = cli_main(capsys, "train", *TINY, "--output_dir", str(out), "--resume_from", str(bogus))
    assert code == 2
    assert err.strip().count("\n") == 0 and "--resume_from" in err and "is not a checkpoint" in err
    assert metrics(out) == []


def test_resume_with_a_different_model_names_the_difference(sync_run, tmp_path, capsys):
    _, sync_root, _ = sync_run
    argv = [*TINY, "--output_dir", str(tmp_path), "--resume_from", str(sync_root)]
    argv[argv.index("--embedding_dim") + 1] = "8"
    argv[argv.index("--dense_arch_layer_sizes") + 1] = "32,8"
    code, _, err = cli_main(capsys, "train", *argv)
    assert code == 2 and "--resume_from" in err and "--embedding_dim 16 (saved) vs 8 (now)" in err


def test_missing_bucket_fails_before_training(s3_service, monkeypatch, tmp_path, capsys):
    for key, value in s3_service.env.items():
        monkeypatch.setenv(key, value)
    argv = ["train", *TINY, "--output_dir", str(tmp_path), "--checkpoint_path", "s3://no-such-bucket-ckpt/run"]
    code, _, err = cli_main(capsys, *argv)
    assert code == 2 and "--checkpoint_path" in err and "no-such-bucket-ckpt" in err and "not found" in err


def test_unreachable_storage_and_wrong_credentials_fail_before_training(azure_service, monkeypatch, tmp_path, capsys):
    s3 = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    wrong_key = azure_service.env["AZURE_STORAGE_CONNECTION_STRING"].replace("AccountKey=Eby8", "AccountKey=AAAA")
    assert AZURITE_ACCOUNT in wrong_key
    cases = [
        ("s3://bucket/run", s3, "unreachable"),
        (f"{azure_service.url}/run", {"AZURE_STORAGE_CONNECTION_STRING": wrong_key}, "access denied"),
    ]
    for url, variables, expected in cases:
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        out = tmp_path / url.split(":")[0]
        code, _, err = cli_main(capsys, "train", *TINY, "--output_dir", str(out), "--checkpoint_path", url)
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("torchrec-cloud train: error: --checkpoint_path"), err
        assert expected in err and url in err
        assert metrics(out) == []  # nothing started, not even the start record
