"""Checkpoints, datasets and model folders are input someone else may have written: every crafted
file we know of, run as a user runs it (``cli.main`` in this process), ends in one line naming
the file and the field, a non-zero exit, nothing run that the file names and nothing outside its
folder read. Memory and time stay bounded by construction (each file is checked before anything
is allocated from it, reads are capped), so no test here times anything.

The crafted inputs are listed in docs/security.md; the security review that found them is issue
#30. Also here: the checkpoint owner (another job's checkpoints are never overwritten or deleted),
readers' leases, the metrics endpoint's default address, base images by digest, install.sh.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from checkpoint_runs import TINY
from helpers import REPO, free_port
from test_bad_inputs import cli_error
from torchrec_cloud import checksum, cli, storage
from torchrec_cloud.checkpoint import load_full_state, store
from torchrec_cloud.config import ConfigError, parse_job_config
from torchrec_cloud.data.criteo_gen import write_criteo_tsv
from torchrec_cloud.train import run as train


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny 1-rank run's checkpoints (steps 3 and 6), its export, a small preprocessed dataset."""
    root = tmp_path_factory.mktemp("untrusted")
    train(parse_job_config([*TINY, "--output_dir", str(root / "run"), "--num_batches_per_epoch", "6",
                            "--checkpoint_interval", "3", "--checkpoint_path", str(root / "ckpt")]))  # fmt: skip
    assert cli.main(["export", str(root / "ckpt"), "--output", str(root / "model")]) == 0
    write_criteo_tsv(str(root / "train.txt"), rows=700, seed=3)
    assert cli.main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(root / "train.txt"),
                     "--output", str(root / "data"), "--num_embeddings", "100", "--workers", "1"]) == 0  # fmt: skip
    return root


class RunsCode:
    """Unpickling this calls ``os.mkdir(marker)``: a file whose loading leaves the marker ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def checkpoint_copy(work: Path, tmp_path: Path) -> Path:
    target = tmp_path / "step_00000006"
    shutil.copytree(work / "ckpt" / "step_00000006", target)
    return target


def recommit(folder: Path, edit: Callable[[dict], Any] = lambda c: None) -> None:
    """Write COMMIT.json again as its author would: sizes and checksums of the files as they
    are now (the hand that writes a checkpoint writes its checksums too), then ``edit``."""
    commit = json.loads((folder / "COMMIT.json").read_text())
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != "COMMIT.json"}
    commit.update(files=files, bytes=sum(files.values()))
    commit["checksums"]["files"] = {n: checksum.hash_file(str(folder / n)).blocks() for n in files}
    edit(commit)
    (folder / "COMMIT.json").write_text(json.dumps(commit))


def edit_metadata(folder: Path, edit: Callable[[Any], Any]) -> None:
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # ours, in this test: trusted
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    recommit(folder)


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every path the storage layer is asked to open, read, size or list, as they happen."""
    seen: list[str] = []
    for name in ("open", "read_bytes", "size", "list_sizes", "listdir"):
        original = getattr(storage, name)

        def watched(path, *args, _original=original, **kwargs):
            seen.append(str(path))
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(storage, name, watched)
    return seen


def assert_inside(paths: list[str], folder: Path) -> None:
    root = os.path.realpath(folder)
    outside = [p for p in paths if os.path.commonpath([root, os.path.realpath(p)]) != root]
    assert not outside, outside


# -- checkpoints: code -------------------------------------------------------------------------


def test_a_metadata_that_runs_code_when_unpickled_is_never_unpickled(work, tmp_path, capsys):
    folder = checkpoint_copy(work, tmp_path)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    recommit(folder)
    said = ".metadata: not a DCP index this version reads (UnpicklingError: posix.mkdir is not allowed"
    cli_error(capsys, 1, ["checkpoint", "inspect", str(folder)], f"{folder}: DAMAGED: {said}")
    cli_error(capsys, 1, ["checkpoint", "verify", str(folder)], f"{folder}: DAMAGED: {said}")
    cli_error(capsys, 1, ["export", str(folder), "--output", str(tmp_path / "model")], said)
    cli_error(capsys, 2, ["train", *TINY, "--num_batches_per_epoch", "6", "--output_dir", str(tmp_path / "run"),
                          "--resume_from", str(folder)], "--resume_from", said)  # fmt: skip
    assert cli.main(["checkpoint", "ls", "--verify", str(tmp_path)]) == 1  # a DAMAGED row fails --verify
    assert f"DAMAGED: {said}" in capsys.readouterr().out
    assert not marker.exists()


def test_a_non_tensor_entry_that_runs_code_when_loaded_is_never_run(work, tmp_path, capsys):
    """DCP saves non-tensor values with torch.save and loads them with
    torch.load(weights_only=False). Our checkpoints hold none (the RNG states are tensors), but
    an older one's pickled generators, or a crafted .metadata, can declare one: this one is the
    Python generator's entry rewritten as such, in place."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    folder = checkpoint_copy(work, tmp_path)
    marker = tmp_path / "ran"
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    (index, info) = next((k, v) for k, v in metadata.storage_data.items() if k.fqn == "rng.rank_0.python")
    payload = tmp_path / "payload"
    torch.save(RunsCode(marker), payload)
    assert payload.stat().st_size <= info.length  # it fits where the entry was: no other entry moves
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(payload.read_bytes())

    def as_pickled_entry(md) -> None:
        md.state_dict_metadata["rng.rank_0.python"] = BytesStorageMetadata()
        entry = md.storage_data.pop(index)
        entry.length = payload.stat().st_size
        md.storage_data[MetadataIndex("rng.rank_0.python")] = entry

    edit_metadata(folder, as_pickled_entry)
    said = "rng.rank_0.python of"
    cli_error(capsys, 1, ["export", str(folder), "--output", str(tmp_path / "model")], said, "does not load as data")
    assert not marker.exists()
    with pytest.raises(store.CheckpointDamagedError, match="rng.rank_0.python"):
        load_full_state(str(folder))
    assert not marker.exists()


# -- checkpoints: names and numbers ------------------------------------------------------------


def _first_entry(md):
    return next(iter(md.storage_data.values()))


def _huge_table(md):
    key = next(k for k in md.state_dict_metadata if ".embedding_bags." in k and k.startswith("model."))
    entry = md.state_dict_metadata[key]
    entry.size = torch.Size([10**12, entry.size[1]])
    entry.chunks[0].sizes = torch.Size([10**12, entry.size[1]])


def _deep_list(md):
    key = next(iter(md.planner_data))
    md.planner_data[key] = ("model", 10**9)


METADATA_CRAFTS = {
    "relative path up": (lambda md: setattr(_first_entry(md), "relative_path", "../outside.distcp"),
                         "../outside.distcp is not a name inside its folder"),
    "absolute path": (lambda md: setattr(_first_entry(md), "relative_path", "/etc/hostname"),
                      "/etc/hostname is not a name inside its folder (an absolute path)"),
    "bytes past the file": (lambda md: setattr(_first_entry(md), "length", 10**12), "are outside __0_0.distcp"),
    "a tensor larger than its bytes": (_huge_table, "elements of 4 bytes in"),
    "a list index of 10^9": (_deep_list, "would build lists longer than the checkpoint's entries"),
}


@pytest.mark.parametrize("craft", METADATA_CRAFTS)
def test_a_metadata_that_names_outside_or_oversized_bytes_is_refused(work, tmp_path, capsys, reads, craft):
    edit, said = METADATA_CRAFTS[craft]
    folder = checkpoint_copy(work, tmp_path)
    edit_metadata(folder, edit)
    reads.clear()
    cli_error(capsys, 1, ["checkpoint", "inspect", str(folder)], f"{folder}: DAMAGED: .metadata: ", said)
    assert_inside(reads, folder)
    cli_error(capsys, 1, ["export", str(folder), "--output", str(tmp_path / "model")], said)


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(commit: dict) -> None:
        *parents, last = path.split(".")
        target = commit
        for p in parents:
            target = target[p]
        target[last] = value

    return edit


def _add_file(name: str, size: int) -> Callable[[dict], None]:
    def edit(commit: dict) -> None:
        commit["files"][name] = size
        commit["checksums"]["files"][name] = []

    return edit


COMMIT_CRAFTS = {
    "../../secret.txt": (_add_file("../../secret.txt", 6), "files: ../../secret.txt is not a name inside its folder"),
    "/etc/hostname": (_add_file("/etc/hostname", 6), "files: /etc/hostname is not a name inside its folder"),
    "/dev/zero of size 0": (_add_file("/dev/zero", 0), "files: /dev/zero is not a name inside its folder"),
    "block_bytes 0": (_set("checksums.block_bytes", 0), "checksums.block_bytes: must be an integer in 4096.."),
    "created {}": (_set("created", {}), "created: must be printable text"),
    "files as a list": (_set("files", [".metadata"]), "files: must be an object"),
    "a negative step": (_set("step", -1), "step: must be an integer in 0.."),
    "a step near 2^63": (_set("trainer.step", 2**63 - 1), "trainer.step: must be an integer in 0.."),
    "too few checksums": (lambda c: c["checksums"]["files"][".metadata"].clear(),
                          "checksums.files..metadata: must list 1 block checksums"),
}


@pytest.mark.parametrize("craft", COMMIT_CRAFTS)
def test_a_commit_json_that_names_outside_files_or_bad_numbers_is_refused(work, tmp_path, capsys, reads, craft):
    edit, said = COMMIT_CRAFTS[craft]
    (tmp_path / "secret.txt").write_text("secret")
    folder = checkpoint_copy(work, tmp_path / "runs")
    recommit(folder, edit)
    reads.clear()
    cli_error(capsys, 1, ["checkpoint", "verify", str(folder)], f"{folder}: DAMAGED: COMMIT.json: {said}")
    cli_error(capsys, 1, ["checkpoint", "inspect", str(folder)], f"COMMIT.json: {said}")
    assert_inside(reads, folder)
    with pytest.warns(store.CheckpointWarning, match=re.escape(said)):
        assert store.newest_complete(str(folder.parent)) is None  # resume skips it, naming why


def test_a_file_that_leads_out_of_the_checkpoint_is_refused(work, tmp_path, capsys):
    folder = checkpoint_copy(work, tmp_path / "runs")
    (tmp_path / "outside").write_bytes((folder / ".metadata").read_bytes())
    (folder / ".metadata").unlink()
    (folder / ".metadata").symlink_to(tmp_path / "outside")
    cli_error(capsys, 1, ["checkpoint", "verify", str(folder)], "COMMIT.json: files: .metadata leads out of its folder")


def test_escape_codes_in_a_checkpoint_never_reach_the_terminal(work, tmp_path, capsys):
    folder = checkpoint_copy(work, tmp_path)
    recommit(folder, _set("created", "\x1b[2J\x1b]0;owned\x07"))
    assert cli.main(["checkpoint", "ls", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert "created: must be printable text of at most 64 characters, got \\x1b[2J\\x1b]0;owned\\x07" in out


def test_inspect_of_a_run_folder_says_when_it_reads_checkpoints_elsewhere(work, tmp_path, capsys):
    run = tmp_path / "downloaded-run"
    run.mkdir()
    start = {"event": "start", "config": {"checkpoint": {"checkpoint_path": str(work / "ckpt")}}}
    (run / "metrics.jsonl").write_text(json.dumps(start) + "\n" + "x" * (2 << 20))  # and a line without end
    assert cli.main(["checkpoint", "inspect", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"whose run wrote its checkpoints to {work / 'ckpt'} (from its metrics.jsonl): reading them there" in err
    assert "step_00000006" in out
    start["config"]["checkpoint"]["checkpoint_path"] = "ftp://elsewhere/\x1b[31m"
    (run / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    err = cli_error(capsys, 1, ["checkpoint", "inspect", str(run)], f"{run}: no COMMIT.json")
    assert "names a --checkpoint_path that is not a path or URL we read (ftp://elsewhere/\\x1b[31m): not following" in err
    assert "\x1b" not in err


# -- checkpoints: owners and readers ------------------------------------------------------------


def test_a_named_job_does_not_start_on_another_jobs_checkpoints(work, tmp_path, capsys):
    root = tmp_path / "ckpt"
    shutil.copytree(work / "ckpt", root)
    before = sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*"))
    owner = json.loads((root / "step_00000006" / "COMMIT.json").read_text())["owner"]
    cli_error(capsys, 2, ["train", *TINY, "--num_batches_per_epoch", "9", "--checkpoint_interval", "3",
                          "--output_dir", str(tmp_path / "b"), "--checkpoint_path", str(root), "--job_id", "job-b"],
              "--checkpoint_path", f"holds checkpoints of job {owner} (step_00000006); this is job job-b")  # fmt: skip
    assert sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


def test_a_save_never_overwrites_or_deletes_another_jobs_checkpoint(tmp_path, capsys):
    """Job B starts on a folder where job A's save of step 3 is under way (its OWNER.json
    written, not committed): B's save of step 3 stops with one line; A's files stay."""
    root = tmp_path / "ckpt"
    store.write_owner(str(root / "step_00000003"), "job-a")
    (root / "step_00000003" / "__0_0.distcp").write_bytes(b"A's bytes")
    cli_error(capsys, 2, ["train", *TINY, "--num_batches_per_epoch", "6", "--checkpoint_interval", "3",
                          "--output_dir", str(tmp_path / "b"), "--checkpoint_path", str(root), "--job_id", "job-b"],
              "--checkpoint_path", "step_00000003 is being written by job job-a; this job (job-b) does not overwrite")  # fmt: skip
    assert (root / "step_00000003" / "__0_0.distcp").read_bytes() == b"A's bytes"


def test_the_job_id_is_the_flag_the_environment_or_a_named_rendezvous(monkeypatch):
    from torchrec_cloud.checkpoint.checkpointer import named_job_id

    monkeypatch.delenv("TORCHREC_CLOUD_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default
    assert named_job_id(None) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0f6d5a3e-9c1b-4a57-8e2f-5b7c9d1e3a24")  # torchrun's single-node id
    assert named_job_id(None) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "dlrm-a")  # --rdzv_id=dlrm-a, as the rendered manifests pass
    assert named_job_id(None) == "dlrm-a"
    monkeypatch.setenv("TORCHREC_CLOUD_JOB_ID", "dlrm-b")
    assert named_job_id(None) == "dlrm-b" and named_job_id("dlrm-c") == "dlrm-c"
    monkeypatch.setenv("TORCHREC_CLOUD_JOB_ID", "a\nb")
    with pytest.raises(ConfigError, match=r"--job_id: \$TORCHREC_CLOUD_JOB_ID must be"):
        named_job_id(None)


def test_attempts_jsonl_is_input_not_a_verdict(tmp_path, capsys):
    """attempts.jsonl (the restart budget's record, beside the checkpoints) may be damaged or
    crafted: each bad line is left out with one warning naming the file, the line and the
    field, and the run trains; another named job's starts are not this job's; the rewrite
    keeps only sound lines; retention and `checkpoint ls --verify` leave the file alone."""
    root = tmp_path / "ckpt"
    root.mkdir()
    other = json.dumps({"resumed_from": 0, "time": "2026-11-25T00:00:00+00:00", "world_size": 1, "job": "job-a"})
    (root / "attempts.jsonl").write_bytes("\n".join([
        other, other, other,  # job A looping at step 0: no reason for job B to give up
        "{not json",
        json.dumps({"resumed_from": "six"}),
        json.dumps({"resumed_from": -1}),
        json.dumps({"resumed_from": 0, "job": "a b\x1b[31m"}),
        "x" * 5000,
    ]).encode() + b"\n")
    with pytest.warns(store.CheckpointWarning) as caught:
        code = cli.main(["train", *TINY, "--num_batches_per_epoch", "6", "--checkpoint_interval", "3",
                         "--checkpoint_keep", "1", "--output_dir", str(tmp_path / "run"),
                         "--checkpoint_path", str(root), "--job_id", "job-b"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    said = [str(w.message) for w in caught if "attempts.jsonl" in str(w.message)]
    path = root / "attempts.jsonl"
    assert [line.split(": line left out")[0] for line in said] == [
        f"{path}:4 is not a JSON object",
        f"{path}:5: resumed_from: must be an integer in 0..{2**53}, got six",
        f"{path}:6: resumed_from: must be an integer in 0..{2**53}, got -1",
        f"{path}:7: job: must be printable text of at most 128 characters, got a b\\x1b[31m",
        f"{path}:8 is longer than 4096 bytes",
    ]
    assert all("\n" not in line and "\x1b" not in line for line in said)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(a["resumed_from"], a.get("job")) for a in kept] == [(0, "job-a")] * 3 + [(0, "job-b")]
    assert sorted(p.name for p in root.iterdir()) == ["attempts.jsonl", "step_00000006"]  # retention kept it
    capsys.readouterr()
    assert cli.main(["checkpoint", "ls", "--verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step_00000006" in out and "attempts.jsonl" not in out and "DAMAGED" not in out

    # The same job's own loop ends the start: the budget still counts what it should.
    looping = tmp_path / "looping"
    looping.mkdir()
    (looping / "attempts.jsonl").write_text((json.dumps({"resumed_from": 0, "job": "job-b"}) + "\n") * 3)
    cli_error(capsys, 2, ["train", *TINY, "--output_dir", str(tmp_path / "loop"), "--checkpoint_path", str(looping),
                          "--job_id", "job-b"],
              "--no_progress_restarts", "no progress since step 0 in 3 restarts")  # fmt: skip


def _commit(folder: Path, step: int, owner: str) -> None:
    trainer = {"step": step, "epoch": 0, "batch": step, "scheduler": {"step_count": step, "base_lrs": [0.1]}}
    commit = {"format": 2, "step": step, "files": {}, "trainer": trainer, "owner": owner}
    storage.write_bytes(str(folder / store.checkpoint_name(step) / "COMMIT.json"), json.dumps(commit).encode())


def test_retention_deletes_only_its_own_checkpoints_that_no_reader_holds(tmp_path):
    for step, owner in [(1, "a"), (2, "b"), (3, "a"), (4, "a"), (5, "b"), (6, "a")]:
        _commit(tmp_path, step, owner)
    with store.lease(str(tmp_path / "step_00000003"), "export") as held:
        assert held
        deleted = store.apply_retention(str(tmp_path), keep=1, owner="a")
    assert sorted(Path(p).name for p in deleted) == ["step_00000001", "step_00000004"]  # not b's, nor the leased one
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_0000000{i}" for i in (2, 3, 5, 6)]
    assert not any(p.name.startswith(".lease-") for p in (tmp_path / "step_00000003").iterdir())  # lease given back
    assert [Path(p).name for p in store.apply_retention(str(tmp_path), keep=1, owner="a")] == ["step_00000003"]


def test_export_holds_a_lease_while_it_reads(work, tmp_path, monkeypatch, capsys):
    from torchrec_cloud.serving import export

    held = []
    original = export.load_full_state
    monkeypatch.setattr(export, "load_full_state", lambda path: held.append(store.leased(path)) or original(path))
    assert cli.main(["export", str(work / "ckpt"), "--output", str(tmp_path / "model")]) == 0
    assert held == [True] and not store.leased(str(work / "ckpt" / "step_00000006"))


# -- datasets ------------------------------------------------------------------------------------


def data_copy(work: Path, tmp_path: Path, edit: Callable[[dict], Any]) -> Path:
    folder = tmp_path / "data"
    shutil.copytree(work / "data", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _shard(key: str, value: Any) -> Callable[[dict], None]:
    return lambda m: m["shards"][0].update({key: value})


MANIFEST_CRAFTS = {
    "../../etc/passwd": (_shard("path", "../../etc/passwd"), "shards[0].path: ../../etc/passwd is not a name inside"),
    "/etc/hostname": (_shard("path", "/etc/hostname"), "shards[0].path: /etc/hostname is not a name inside"),
    "s3:// shard": (_shard("path", "s3://bucket/x.bin"), "shards[0].path: s3://bucket/x.bin is not a name inside"),
    "10^15 rows": (_shard("rows", 10**15), "shards[0].rows: must be an integer in 0..281474976710656"),
    "2^63 - 1 rows": (_shard("rows", 2**63 - 1), "shards[0].rows: must be an integer in 0.."),
    "-5 rows": (_shard("rows", -5), "shards[0].rows: must be an integer in 0.."),
    "a split past its shard": (lambda m: m["splits"]["train"].__setitem__(0, [0, 0, 10**9]),
                               "splits.train[0]: must be an integer in 0.."),
    "a split listed twice": (lambda m: m["splits"]["val"].extend(m["splits"]["train"] * 2),
                             "splits: hold"),
    "splits as a list": (lambda m: m.update(splits=[]), "splits: must be an object"),
}


@pytest.mark.parametrize("craft", MANIFEST_CRAFTS)
def test_a_manifest_that_names_outside_files_or_impossible_rows_is_refused(work, tmp_path, capsys, reads, craft):
    edit, said = MANIFEST_CRAFTS[craft]
    folder = data_copy(work, tmp_path, edit)
    reads.clear()
    cli_error(capsys, 1, ["data", "verify", str(folder)], f"{folder / 'manifest.json'}: {said}")
    assert_inside(reads, folder)
    cli_error(capsys, 2, ["train", "--dataset_path", str(folder), *TINY, "--output_dir", str(tmp_path / "run")],
              "--dataset_path", said)  # fmt: skip


def test_a_manifest_claiming_rows_its_shards_do_not_hold_stops_at_open(work, tmp_path, capsys):
    def edit(m: dict) -> None:
        rows = 10**12
        m["shards"][0].update(rows=rows, bytes=rows * m["record"]["bytes_per_row"])
        m["rows"] = sum(s["rows"] for s in m["shards"])

    folder = data_copy(work, tmp_path, edit)
    cli_error(capsys, 2, ["train", "--dataset_path", str(folder), *TINY, "--output_dir", str(tmp_path / "run")],
              "--dataset_path", "bytes, the manifest says")  # fmt: skip


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_a_line_without_newline_is_an_error_not_a_memory_sink(work, tmp_path, capsys, gz):
    path = tmp_path / ("huge.txt.gz" if gz else "huge.txt")
    line = b"1\t" + b"a" * (10 << 20)  # 10 MB, no newline
    path.write_bytes(gzip.compress(line, compresslevel=1) if gz else line)
    said = f"{path}: a line is longer than 1048576 bytes (no newline): not a Criteo TSV file"
    cli_error(capsys, 1, ["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(path),
                          "--output", str(tmp_path / "out"), "--workers", "1"], said)  # fmt: skip
    cli_error(capsys, 1, ["predict", str(work / "model"), "--dataset_path", str(path), "--output",
                          str(tmp_path / "p.csv"), "--no_progress"], said)  # fmt: skip


def test_a_crafted_plan_or_shard_marker_of_a_preprocessing_run_is_refused(work, tmp_path, capsys):
    argv = ["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(work / "train.txt"),
            "--num_embeddings", "100", "--workers", "1"]  # fmt: skip
    out = tmp_path / "plan-list"
    out.mkdir()
    (out / "_plan.json").write_text("[1, 2]")
    cli_error(capsys, 1, [*argv, "--output", str(out)], f"{out / '_plan.json'} is not a JSON object")
    out = tmp_path / "marker"
    cli.main([*argv, "--output", str(out)])
    capsys.readouterr()
    (out / "manifest.json").unlink()  # an interrupted run: its markers are read again
    marker = next((out / "shards").glob("*.done"))
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "shard": "../../secret.bin"}))
    cli_error(capsys, 1, [*argv, "--output", str(out)], f"{marker}: shard: must be one of")


MODEL_CRAFTS = {
    "a file outside": (lambda c: c.update(files={"../scorer.pt": 1}), "files: must be one of"),
    "a shorter scorer": (lambda c: c["files"].update({"scorer.pt": 10}), "scorer.pt holds more than 10 bytes"),
    "embedding_dim as text": (lambda c: c["model"].update(embedding_dim="64"), "model.embedding_dim: must be an integer"),
}


@pytest.mark.parametrize("craft", MODEL_CRAFTS)
def test_a_model_config_with_bad_fields_is_refused(work, tmp_path, capsys, craft):
    edit, said = MODEL_CRAFTS[craft]
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    config = json.loads((model / "model_config.json").read_text())
    edit(config)
    (model / "model_config.json").write_text(json.dumps(config))
    cli_error(capsys, 1, ["predict", str(model), "--dataset_path", str(work / "data"), "--output",
                          str(tmp_path / "p.csv"), "--no_progress"], said)  # fmt: skip


# -- the rest of the trust boundary ----------------------------------------------------------------


def test_the_metrics_endpoint_binds_this_machine_unless_told_otherwise():
    from torchrec_cloud.metrics.prometheus import PrometheusSink

    cfg = parse_job_config(["--prometheus_port", str(free_port())])
    sink = PrometheusSink(cfg.output.prometheus_port, host=cfg.output.metrics_host)
    try:
        assert sink._server.socket.getsockname()[0] == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", cfg.output.prometheus_port), timeout=30):
            pass
    finally:
        sink.close()


def test_base_images_are_pinned_by_digest_of_their_tag():
    from torchrec_cloud.deploy import layout

    for path in ("docker/Dockerfile.cpu", "docker/Dockerfile.cuda", "quickstart/Dockerfile"):
        (base,) = [ln.split()[1] for ln in (REPO / path).read_text().splitlines() if ln.startswith("FROM ")]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), (path, base)
    flavour = dict(layout.images()["flavours"]["cuda"])
    stack = {**layout.read_stack(), "TORCH_VERSION": "9.9.9"}  # a new torch: the old digest is another image
    with pytest.raises(ValueError, match=r"flavours.cuda.digest must pin pytorch/pytorch:9\.9\.9-cuda13\.0"):
        layout.pinned_base("cuda", flavour, stack)


def test_install_script_takes_torch_only_from_its_index_and_writes_no_fixed_tmp_path():
    script = (REPO / "scripts" / "install.sh").read_text()
    code = "\n".join(ln for ln in script.splitlines() if not ln.lstrip().startswith("#"))
    assert "--extra-index-url" not in code and 'torch_index=(--index-url "$TORCH_INDEX_URL")' in code
    assert '"${pip[@]}" "${torch_index[@]}" "torch==$TORCH_VERSION" 2>&1' in code  # torch alone in that step
    assert "/tmp/" not in code and "mktemp" in code


# -- flags that reach a manifest ----------------------------------------------------------


@pytest.mark.parametrize("command", ["render", "submit"])
@pytest.mark.parametrize("flag, value", [
    ("--image", "torchrec-cloud:0.1.0\n      hostPID: true"),  # the review's crafted input
    ("--image", "torchrec-cloud:0.1.0 hostPID: true"),
    ("--image", "Torchrec-Cloud:latest"),
    ("--checkpoint_url", "s3://bucket/ckpt\nhostNetwork: true"),
    ("--data_url", "s3://bucket/data\r\n  - name: x"),
    ("--identity", "arn:aws:iam::1:role/r\u2028hostIPC: true"),
    ("--shm_size", "8Gi\nhostPID: true"),
    ("--name", "dlrm\nhostPID"),
])
def test_a_flag_value_that_could_add_a_key_is_refused_and_nothing_written(tmp_path, capsys, command, flag, value):
    out = tmp_path / "out"
    where = ["--output", str(out)] if command == "render" else ["--dry-run"]
    cli_error(capsys, 2, [command, "--cloud", "generic", "--gpus_per_node", "0", *where, f"{flag}={value}"],
              f"{flag}:")
    assert not out.exists()


def test_a_training_flag_with_a_line_break_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    cli_error(capsys, 2, ["render", "--cloud", "generic", "--gpus_per_node", "0", "--output", str(out), "--",
                          "--job_id", "a\nhostPID: true"], "training flags")
    assert not out.exists()


def _strings(value: Any, swap: dict[str, str]) -> Any:
    """``value`` with every string that is a key of ``swap`` replaced."""
    if isinstance(value, dict):
        return {_strings(k, swap): _strings(v, swap) for k, v in value.items()}
    if isinstance(value, list):
        return [_strings(v, swap) for v in value]
    return swap.get(value, value) if isinstance(value, str) else value


@pytest.mark.parametrize("launcher", ["job", "pytorchjob", "trainjob"])
def test_values_that_pass_validation_stay_values(launcher):
    """Valid but hostile values (YAML syntax, quotes, comment and anchor marks) render as the
    values they are: the parsed bundle is the plain one with those strings in their places, no
    key more or less."""
    from torchrec_cloud.deploy.manifests import load_documents, render_bundle, render_storage
    from torchrec_cloud.deploy.profiles import load_profile, with_values
    from torchrec_cloud.deploy.spec import DeploySpec

    hostile = {
        "image": "localhost:5000/a__b/c--d:v1.0_rc-1@sha256:" + "e" * 64,
        "checkpoint_url": "s3://b/ckpt: {hostPID: true} # '\" &a *a !!python/object |",
        "data_url": "/data/- hostNetwork: true  [x, y] %{a}",
        "identity": "arn:aws:iam::1:role/x\" hostPID: true #",
        "job_id": "a:b@c/d+e",
        "nfs_server": "10.0.0.1:/x@y",
    }
    plain = {k: f"plain-{k}" for k in hostile}
    plain["image"] = "torchrec-cloud:plain"

    def bundle(v: dict[str, str]) -> list[dict]:
        profile = with_values(load_profile("azure"), [f"storage.nfs_server={v['nfs_server']}"])
        spec = DeploySpec(cloud="azure", launcher=launcher, nodes=2, gpus_per_node=0, image=v["image"],
                          checkpoint_url=v["checkpoint_url"], data_url=v["data_url"], identity=v["identity"],
                          train_args=["--job_id", v["job_id"]])
        return load_documents(render_bundle(spec, profile) + "---\n" + render_storage(spec, profile))

    got = bundle(hostile)
    assert _strings(got, {hostile[k]: plain[k] for k in hostile}) == bundle(plain)
    text = json.dumps(got)
    for value in hostile.values():
        assert json.dumps(value)[1:-1] in text  # each value is there, whole


def test_templates_quote_what_they_print_and_refuse_a_raw_line_break():
    """Below validation: the `q` filter keeps any text one value of its key, and a value
    printed without a placing filter cannot break a line (a comment, a shell line)."""
    import yaml

    from torchrec_cloud.deploy.manifests import environment

    hostile = 'x"\n  hostPID: true\nhostNetwork: true # \\ \u2028 \''
    assert yaml.safe_load(environment().from_string("spec:\n  image: {{ v | q }}\n").render(v=hostile)) == {
        "spec": {"image": hostile}}
    with pytest.raises(ConfigError, match="line break"):
        environment().from_string("# note: {{ v }}\nimage: x\n").render(v="a\nhostPID: true")
    with pytest.raises(ConfigError, match="shell script"):
        environment().from_string('X="${X:-{{ v | shword }}}"').render(v="$(touch /tmp/x)")
