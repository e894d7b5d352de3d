"""Multi-rank checkpoints through the real launcher (torchrun, gloo): a run stopped by
SIGTERM or by a killed rank resumes to exactly the result of an uninterrupted run, a damaged
newest checkpoint is passed over for the one before it to the same result, and a checkpoint
moves between 2 ranks and 1 rank with the same evaluation metrics."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest
import torch

from checkpoint_runs import LAUNCH, check, children, flip_bytes, last, metrics, run, start, train_cmd, wait_for
from torchrec_cloud import checkpoint, cli
from torchrec_cloud.launch import EXIT_PREEMPTED

EPOCHS = 3  # 60 steps of the tiny model
STEPS = EPOCHS * 20
COMMON = ["--num_epochs", str(EPOCHS), "--log_every", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """2 ranks, all steps without interruption, a checkpoint after each epoch (three); the
    final one holds the result."""
    out = tmp_path_factory.mktemp("reference")
    check(run(train_cmd(2, out, *COMMON, "--checkpoint_path", str(out / "ckpt"), "--checkpoint_interval", "20")))
    return out


def final_state(root: Path) -> dict[str, torch.Tensor]:
    info = checkpoint.newest_complete(str(root))
    assert info is not None, f"no complete checkpoint under {root}"
    assert info.step == STEPS
    # RNG states are per rank and not part of the model's result.
    return {k: v for k, v in checkpoint.load_full_state(info.path).items() if not k.startswith("rng.")}


def assert_same_state(expected: dict, actual: dict) -> None:
    assert sorted(expected) == sorted(actual)
    tables = [k for k in expected if "embedding_bags" in k]
    assert tables and any(k.endswith("momentum1") for k in expected), "tables and fused optimizer state saved"
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def eval_metrics(records: list[dict]) -> dict[str, tuple[float, float]]:
    return {s: (last(records, event="eval", split=s)["auc"], last(records, event="eval", split=s)["logloss"]) for s in ("val", "test")}


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers under ``launcher``."""
    ranks = {}
    for pid in children(launcher):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"RANK" in values:
            ranks[int(values[b"RANK"])] = pid
    return ranks


def test_sigterm_on_one_rank_stops_all_saves_and_resumes_exactly(reference, tmp_path):
    out = tmp_path / "run"
    cmd = train_cmd(2, out, *COMMON, "--checkpoint_path", str(out / "ckpt"), launcher=LAUNCH)
    proc = start(cmd)
    wait_for(lambda: any(r.get("event") == "train" and r["step"] >= 10 for r in metrics(out)), proc, 300, "step 10")
    # Only rank 1 is told; the ranks agree through their per-step all-reduce.
    workers = worker_pids(proc.pid)
    signalled = time.monotonic()
    os.kill(workers[1], signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    stopped_after = time.monotonic() - signalled
    # Not finished: the launcher must not exit 0, and says why in one line.
    assert proc.returncode == EXIT_PREEMPTED, f"exit {proc.returncode} after SIGTERM:\n{output[-4000:]}"
    assert f"torchrec-cloud launch: the run stopped for a preemption (checkpoint saved where one is configured); exit {EXIT_PREEMPTED}" in output
    assert "Traceback" not in output, output[-4000:]
    assert stopped_after < 30, f"took {stopped_after:.1f}s to stop (Kubernetes' default grace period is 30s)"

    records = metrics(out)
    saved = last(records, event="checkpoint")
    assert saved["reason"] == "preempted" and 10 <= saved["step"] < STEPS, saved
    assert last(records, event="end")["preempted"] is True
    assert not [r for r in records if r.get("event") == "eval"], "a preempted run stops without evaluating"
    info = checkpoint.newest_complete(str(out / "ckpt"))
    assert info.step == saved["step"] and info.world_size == 2

    check(run(cmd))  # the same command again resumes
    records = metrics(out)
    resumed = last(records, event="resume")
    assert (resumed["step"], resumed["path"]) == (saved["step"], saved["path"])
    assert last(records, event="end")["step"] == STEPS
    assert eval_metrics(records) == eval_metrics(metrics(reference))
    assert_same_state(final_state(reference / "ckpt"), final_state(out / "ckpt"))


def test_kill9_of_one_rank_restarts_the_group_which_resumes_and_finishes(reference, tmp_path):
    out = tmp_path / "run"
    cmd = train_cmd(
        2, out, *COMMON, "--checkpoint_path", str(out / "ckpt"), "--checkpoint_interval", "10", max_restarts=1
    )
    # torchrun's shared rendezvous store keeps the dead group's keys, so a restarted gloo
    # group may dial a dead peer (pytorch/pytorch#135712); docs/checkpoints.md says the same.
    proc = start(cmd, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    wait_for(lambda: any(r.get("event") == "checkpoint" for r in metrics(out)), proc, 300, "the first checkpoint")
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, f"the restarted group must finish:\n{output[-4000:]}"

    records = metrics(out)
    resumed = last(records, event="resume")
    assert resumed["step"] >= 10 and resumed["world_size"] == 2
    assert last(records, event="end")["step"] == STEPS
    assert eval_metrics(records) == eval_metrics(metrics(reference))
    assert_same_state(final_state(reference / "ckpt"), final_state(out / "ckpt"))


def assert_same_metrics(before: list[dict], after: list[dict]) -> None:
    for split in ("val", "test"):
        b, a = last(before, event="eval", split=split), last(after, event="eval", split=split)
        assert a["step"] == b["step"]
        # Same weights, same batches; only the order of a float64 sum may differ.
        assert a["auc"] == pytest.approx(b["auc"], abs=1e-9), split
        assert a["logloss"] == pytest.approx(b["logloss"], abs=1e-9), split


def test_two_rank_checkpoint_resumes_on_one_rank(reference, tmp_path):
    out = tmp_path / "one"
    check(run(train_cmd(1, out, *COMMON, "--resume_from", str(reference / "ckpt"))))
    records = metrics(out)
    resumed = last(records, event="resume")
    assert (resumed["saved_world_size"], resumed["world_size"]) == (2, 1)
    assert_same_metrics(metrics(reference), records)


def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    check(run(train_cmd(1, one, "--checkpoint_path", str(one / "ckpt"))))
    check(run(train_cmd(2, two, "--resume_from", str(one / "ckpt"))))
    records = metrics(two)
    resumed = last(records, event="resume")
    assert (resumed["saved_world_size"], resumed["world_size"]) == (1, 2)
    assert_same_metrics(metrics(one), records)


def test_sigterm_with_a_frozen_peer_exits_after_the_stall_limit_not_the_launchers_kill(tmp_path):
    """A peer that stops answering (a frozen node; on GPUs, NCCL waits for a dead one too)
    leaves the other rank inside a collective, where a SIGTERM only sets a flag. It must
    give up after --stop_stall_s, not hold the restart until torchrun's SIGKILL."""
    out = tmp_path / "run"
    cmd = train_cmd(2, out, "--num_epochs", "200", "--log_every", "1", "--stop_stall_s", "3",
                    "--checkpoint_path", str(out / "ckpt"), launcher=LAUNCH)  # fmt: skip
    cmd.insert(cmd.index("-m", len(LAUNCH)), "--shutdown_timeout=120")  # torchrun's SIGKILL comes late
    proc = start(cmd)
    try:
        wait_for(lambda: any(r.get("event") == "train" and r["step"] >= 5 for r in metrics(out)), proc, 300, "step 5")
        workers = worker_pids(proc.pid)
        os.kill(workers[1], signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 is now waiting on rank 1 in a collective
        signalled = time.monotonic()
        os.kill(workers[0], signal.SIGTERM)
        while Path(f"/proc/{workers[0]}").exists() and time.monotonic() - signalled < 60:
            if Path(f"/proc/{workers[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break  # exited; its parent has not reaped it yet
            time.sleep(0.1)
        gone_after = time.monotonic() - signalled
    finally:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        output = proc.communicate(timeout=60)[0]
    assert gone_after < 20, f"rank 0 still running {gone_after:.0f}s after SIGTERM:\n{output[-3000:]}"
    assert "no training step has finished for 3 s" in output, output[-3000:]


@pytest.mark.parametrize("damaged", ["__1_0.distcp", ".metadata"])
def test_damaged_newest_checkpoint_is_passed_over_for_the_one_before(reference, tmp_path, capsys, damaged):
    """Rank 1's tensors (found while loading, by rank 1, and every rank falls back with it)
    or DCP's index (found before the model is built) of the newest of three checkpoints."""
    out, root = tmp_path / "run", tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", root)
    newest = root / checkpoint.checkpoint_name(STEPS)
    assert [i.step for i in checkpoint.list_checkpoints(str(root)) if i.complete] == [20, 40, 60]
    flip_bytes(newest / damaged)
    assert checkpoint.inspect_checkpoint(str(newest)).complete  # sizes alone call it whole

    assert cli.main(["checkpoint", "verify", str(root)]) == 1
    err = capsys.readouterr().err
    assert f"{newest}: DAMAGED: {damaged}: bytes " in err and "checksum mismatch" in err, err
    assert cli.main(["checkpoint", "ls", "--verify", str(root)]) == 1  # a DAMAGED row: exit 1
    listed = capsys.readouterr().out
    assert "step_00000040" in listed and f"DAMAGED: {damaged}" in listed, listed

    proc = run(train_cmd(2, out, *COMMON, "--checkpoint_path", str(root), "--checkpoint_interval", "20"))
    check(proc)
    warning = f"skipping damaged checkpoint {newest}: {damaged}: bytes "
    assert warning in proc.stderr and f"using {root / 'step_00000040'}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    records = metrics(out)
    resumed = last(records, event="resume")
    assert (resumed["step"], resumed["path"], resumed["verified"]) == (40, str(root / "step_00000040"), True)
    assert last(records, event="end")["step"] == STEPS
    assert eval_metrics(records) == eval_metrics(metrics(reference))
    assert_same_state(final_state(reference / "ckpt"), final_state(root))  # step 60 saved again, whole
    assert checkpoint.verify_checkpoint(str(newest)).complete
    # COMMIT.json is as readable as DCP's own files (both follow the umask)
    assert stat.S_IMODE((newest / "COMMIT.json").stat().st_mode) == stat.S_IMODE((newest / damaged).stat().st_mode)
