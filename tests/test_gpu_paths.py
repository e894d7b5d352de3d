"""GPU runs as TorchRec runs them, held on CPU (issue #33): the control path of each GPU-only
piece, exercised here with TorchRec's and fbgemm's own objects where they run on a CPU, and
by an object that behaves as the GPU one does where they do not. What only a GPU can show
is in bench/gpu_check.sh (the last test checks that it says what it could not run here).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.distributed.train_pipeline import EvalPipelineSparseDist, TrainPipelineSparseDist

import torchrec_cloud.build as build_module
from checkpoint_runs import LAUNCH, TINY, children, last, metrics, start, wait_for
from helpers import REPO, env_for_subprocess
from torchrec_cloud import checkpoint, compat, train
from torchrec_cloud.build import build
from torchrec_cloud.checkpoint import checkpointer as checkpointer_module
from torchrec_cloud.checkpoint import dcp
from torchrec_cloud.checkpoint.checkpointer import Checkpointer, Position
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.prefetch import prefetched
from torchrec_cloud.data.synthetic import SyntheticSource
from torchrec_cloud.distributed import init_distributed
from torchrec_cloud.evaluation import evaluate
from torchrec_cloud.launch import EXIT_PREEMPTED
from torchrec_cloud.metrics import MetricsSink


def config(out: Path, *flags: str):
    return parse_job_config([*TINY, "--output_dir", str(out), *flags])


def trainer_for(cfg):
    env = init_distributed("gloo")  # a world of one in this process
    return env, build(cfg, env), SyntheticSource(cfg, 0, 1)


def steps(trainer, source, first: int, count: int) -> None:
    """``count`` training steps through the trainer's pipeline, drained at the end as the loop's
    segments are."""
    batches = (source.make_batch("train", i) for i in range(first, first + count))
    while True:
        try:
            trainer.pipeline.progress(batches)
        except StopIteration:
            return


def records(out: Path, event: str, **match) -> list[dict]:
    return [r for r in metrics(out) if r.get("event") == event and all(r.get(k) == v for k, v in match.items())]


# -- 1: a pipeline that does not attach a detached model by itself ------------------------


class PrefetchLikeProgress(TrainPipelineSparseDist):
    """TrainPipelineSparseDist with PrefetchTrainPipelineSparseDist's behaviour around detach:
    its progress() never attaches a detached model (torchrec 1.8.0 train_pipelines.py), so its
    fill_pipeline calls set_context on the plain forwards detach put back. The prefetch
    pipeline itself needs CUDA streams to run."""

    def progress(self, dataloader_iter):
        self._model_attached = True  # what the prefetch pipeline's progress() assumes, unchecked
        return super().progress(dataloader_iter)


def test_evaluations_between_segments_attach_the_pipeline_again(tmp_path, monkeypatch):
    flags = ["--num_batches_per_epoch", "9", "--eval_every", "3", "--log_every", "1"]
    reference = train.run(config(tmp_path / "plain", *flags))
    scored = []
    progress = EvalPipelineSparseDist.progress

    def counted(self, it):
        output = progress(self, it)
        scored.append(output[1].numel())
        return output

    monkeypatch.setattr(build_module, "TrainPipelineSparseDist", PrefetchLikeProgress)
    monkeypatch.setattr(EvalPipelineSparseDist, "progress", counted)
    result = train.run(config(tmp_path / "prefetch-like", *flags))
    assert result["step"] == 9
    assert last(metrics(tmp_path / "prefetch-like"), event="start")["pipeline"] == "PrefetchLikeProgress"
    # Training went on after each evaluation exactly as with the pipeline that re-attaches itself.
    trained = [(r["step"], r["loss"]) for r in records(tmp_path / "prefetch-like", "train")]
    assert trained == [(r["step"], r["loss"]) for r in records(tmp_path / "plain", "train")] and len(trained) == 9
    assert [r["step"] for r in records(tmp_path / "prefetch-like", "eval", split="val")] == [3, 6, 9]
    assert (result["val"]["auc"], result["test"]["auc"]) == (reference["val"]["auc"], reference["test"]["auc"])
    # Every evaluation went through TorchRec's eval pipeline: 3 val + 1 test, 4 batches each.
    assert len(scored) == 4 * 4 and set(scored) == {256}


# -- 2: UVM cache rows an evaluation locked: tests/test_eval_gpu_paths.py (issue #43) ------------


# -- 3: RNG states in a checkpoint, any number of GPUs --------------------------------------


def test_rng_states_are_tensors_that_resume_whatever_gpus_either_side_sees(tmp_path, monkeypatch):
    cfg = config(tmp_path, "--num_batches_per_epoch", "2", "--checkpoint_path", str(tmp_path / "ckpt"))
    env, trainer, _ = trainer_for(cfg)
    random.seed(1)
    random.gauss(0, 1)  # a cached second normal: part of the state
    np.random.seed(2)
    np.random.standard_normal(3)
    torch.manual_seed(3)
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    checkpoints = Checkpointer(cfg, env, MetricsSink())  # saved on this CPU: no GPU
    checkpoints.save(Position(2, 1, 0), trainer.dmp, trainer.optimizer, trainer.scheduler, reason="end")
    checkpoints.close()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)

    # Resumed where CUDA reports 8 GPUs (the loader used to ask for one CUDA state per visible
    # GPU, which a checkpoint saved with fewer lacks: "Missing key ... rng.rank_0.cuda.0").
    fake = torch.zeros(16, dtype=torch.uint8)
    with monkeypatch.context() as gpus:
        for name, value in {"is_available": lambda: True, "device_count": lambda: 8,
                            "get_rng_state_all": lambda: [fake] * 8, "set_rng_state_all": lambda states: None,
                            "get_rng_state": lambda device=None: fake, "set_rng_state": lambda *a: None}.items():  # fmt: skip
            gpus.setattr(torch.cuda, name, value)
        resumed = Checkpointer(cfg, env, MetricsSink())
        assert resumed.load(trainer.dmp, trainer.optimizer, trainer.scheduler) == Position(2, 1, 0)
        resumed.close()
    assert torch.equal(torch.get_rng_state(), saved[0])
    assert random.getstate() == saved[1]
    restored = np.random.get_state()
    assert np.array_equal(restored[1], saved[2][1]) and restored[2:] == saved[2][2:]

    # Saved as a rank on a GPU saves it: its own device's generator besides the CPU's, one key
    # whatever the number of GPUs it sees; no pickled object to load.
    real_rng_state = dcp.rng_state
    monkeypatch.setattr(checkpointer_module, "rng_state",
                        lambda device: {**real_rng_state(device), "cuda": torch.arange(16, dtype=torch.uint8)})  # fmt: skip
    checkpoints = Checkpointer(cfg, env, MetricsSink())
    checkpoints.save(Position(3, 1, 1), trainer.dmp, trainer.optimizer, trainer.scheduler, reason="end")
    checkpoints.close()
    info = checkpoint.newest_complete(str(tmp_path / "ckpt"))
    assert info.step == 3
    metadata = checkpoint.read_metadata(info.path, info.commit)
    entries = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("rng.")}
    assert sorted(entries) == [f"rng.rank_0.{n}" for n in ("cuda", "numpy", "python", "torch")]
    assert all(type(e).__name__ == "TensorStorageMetadata" for e in entries.values())
    # A rank on a GPU loads its device's state where the checkpoint has one; a CPU rank never.
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: fake)
    assert sorted(dcp.rng_keys(metadata, 0, torch.device("cuda", 0))) == ["cuda", "numpy", "python", "torch"]
    assert sorted(dcp.rng_keys(metadata, 0, torch.device("cpu"))) == ["numpy", "python", "torch"]
    assert dcp.rng_keys(metadata, 1, torch.device("cpu")) == {}  # a rank the saving run did not have


# -- 4 (and #29's item 7): SIGTERM to a launcher whose ranks have DataLoader workers ---------


def test_sigterm_to_the_launcher_with_data_workers_saves_and_exits_200(tmp_path):
    """torchrun's agent sends SIGTERM to each rank's whole process group, its DataLoader
    workers included; before, they died of it and took their rank down without a save."""
    out = tmp_path / "run"
    proc = start([*LAUNCH, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", "-m", "torchrec_cloud",
                  "train", *TINY, "--output_dir", str(out), "--num_batches_per_epoch", "2000", "--log_every", "1",
                  "--data_workers", "2", "--checkpoint_path", str(out / "ckpt")])  # fmt: skip
    workers = []
    wait_for(lambda: any(r.get("event") == "train" and r["step"] >= 3 for r in metrics(out)), proc, 300, "step 3")
    for rank in children(proc.pid):
        workers.extend(children(rank))  # the ranks' DataLoader workers
    assert len(workers) >= 4, "2 ranks x 2 DataLoader workers"
    os.kill(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_PREEMPTED, output[-4000:]
    for text in ("Traceback", "exited unexpectedly", "killed by signal", "EOFError", "forcefully exiting"):
        assert text not in output, output[-4000:]
    saved = last(metrics(out), event="checkpoint")
    assert saved["reason"] == "preempted"
    info = checkpoint.newest_complete(str(out / "ckpt"))
    assert info is not None and info.step == saved["step"] and info.world_size == 2
    assert last(metrics(out), event="end")["preempted"] is True
    # The workers, in process groups of their own, did not outlive their ranks.
    deadline = time.monotonic() + 120
    while [p for p in workers if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)], "DataLoader workers outlived their ranks"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False  # gone


# -- 5: feature counts known on the host ---------------------------------------------------


@pytest.mark.parametrize("flags", [[], ["--multi_hot_sizes", ",".join(["3", "1"] * 13), "--multi_hot_pooling", "random"]],
                         ids=["one-hot", "multi-hot"])  # fmt: skip
def test_batches_carry_their_feature_counts_and_the_input_dist_copies_none_back(tmp_path, monkeypatch, flags):
    """TorchRec's input dist needs each feature's id count; a KJT without it has it summed
    where its lengths are and copied back (``_safe_tolist``): on a GPU a blocking copy per
    batch. Here the same call is counted, on the same path."""
    from torchrec.sparse import jagged_tensor

    cfg = config(tmp_path, "--num_batches_per_epoch", "6", *flags)
    env, trainer, source = trainer_for(cfg)
    batch = source.make_batch("train", 0)
    kjt = batch.sparse_features
    expected = kjt.lengths().view(len(kjt.keys()), -1).sum(1).tolist()
    assert kjt.length_per_key_or_none() == expected
    assert kjt.offset_per_key_or_none() == np.concatenate([[0], np.cumsum(expected)]).tolist()
    # They travel with the batch: to a device, and from DataLoader worker processes.
    assert batch.to(torch.device("cpu")).sparse_features.length_per_key_or_none() == expected
    from_worker = next(iter(source.train_loader(0, 0, workers=1, pin=False)))
    assert from_worker.sparse_features.length_per_key_or_none() == expected

    computed = []
    real = jagged_tensor._safe_tolist
    monkeypatch.setattr(jagged_tensor, "_safe_tolist", lambda t: computed.append(t.numel()) or real(t))
    steps(trainer, source, 0, 6)
    assert computed == [], f"{len(computed)} counts computed from tensors in 6 steps"


# -- 7: smaller ones -------------------------------------------------------------------------


def test_batches_made_in_the_step_are_pinned_for_the_copy_to_a_gpu():
    class Item:
        pinned = False

        def pin_memory(self):
            copy = Item()
            copy.pinned = True
            return copy

    assert [i.pinned for i in prefetched(iter([Item(), Item()]), depth=0, pin=True)] == [True, True]
    assert [i.pinned for i in prefetched(iter([Item()]), depth=0, pin=False)] == [False]


def test_evaluation_scores_float32_logits_whatever_the_training_precision(tmp_path):
    cfg = config(tmp_path, "--num_batches_per_epoch", "4")
    env, trainer, source = trainer_for(cfg)
    steps(trainer, source, 0, 4)
    model = trainer.pipeline.detach()
    fp32 = evaluate(model, trainer.optimizer, source, "val", env.device)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the training step's context under --precision bf16
        in_bf16_step = evaluate(model, trainer.optimizer, source, "val", env.device)
    trainer.pipeline.attach(model)
    assert in_bf16_step["auc"] == fp32["auc"] and in_bf16_step["logloss"] == fp32["logloss"]
    assert fp32["rows"] == fp32["split_rows"] == 4 * 256


def test_a2_nodes_turn_gpudirect_off_and_a3_nodes_set_no_tcpx_variable():
    from torchrec_cloud.deploy.profiles import load_profile

    profile = load_profile("gcp")
    env = {name: {**profile.env, **instance.env} for name, instance in profile.instances.items()}
    assert not [k for k in env["a3-highgpu-8g"] if "TCPX" in k]  # no host network: tests/test_render.py
    assert env["a2-highgpu-8g"]["NCCL_NET_GDR_LEVEL"] == env["a2-ultragpu-8g"]["NCCL_NET_GDR_LEVEL"] == "0"


def test_profiles_plan_with_the_gpu_memory_cuda_reports():
    from torchrec_cloud.deploy.profiles import load_profile, profile_names

    # What torch.cuda.get_device_properties().total_memory says, the least seen (MiB).
    reported = {"NVIDIA A100 40GB": 42_298_834_944 / 2**20, "NVIDIA A100 80GB": 81_049, "NVIDIA H100 80GB": 81_082}
    seen = set()
    for name in profile_names():
        for instance in load_profile(name).instances.values():
            if instance.gpu in reported:
                assert instance.gpu_memory_gb * 1024 <= reported[instance.gpu], (name, instance.name)
                seen.add(instance.gpu)
    assert seen == set(reported)


# -- issue #31's item 7: periodic evaluations on a fixed sample ----------------------------


def test_periodic_evaluations_score_a_stated_sample_and_the_last_one_the_whole_split(tmp_path, capsys):
    out = tmp_path / "run"
    train.run(config(out, "--num_batches_per_epoch", "6", "--eval_every", "2", "--eval_rows", "300"))
    val = records(out, "eval", split="val")
    assert [(r["step"], r["rows"], r["split_rows"]) for r in val] == [(2, 300, 1024), (4, 300, 1024), (6, 1024, 1024)]
    assert "bayes_auc" not in val[0] and "bayes_auc" in val[-1]  # known for the whole split only
    assert records(out, "eval", split="test")[-1]["rows"] == 1024
    console = capsys.readouterr().out
    assert "[val] step 2  AUC" in console and "(a sample: 300 of 1,024 rows, --eval_rows)" in console
    assert "[val] step 6" in console and console.count("a sample:") == 2
    # The sample is the same rows on any number of ranks.
    cfg = config(out)
    rows = {w: sorted(float(x) for r in range(w) for b, n in SyntheticSource(cfg, r, w).eval_batches("val", 300)
                      for x in b.labels[:n] + 2 * b.dense_features[:n, 0])
            for w in (1, 2, 3)}  # fmt: skip
    assert len(rows[1]) == 300 and rows[1] == rows[2] == rows[3]


# -- the GPU check itself --------------------------------------------------------------------


def test_the_gpu_check_says_which_checks_it_could_not_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run bench/gpu_check.sh itself")
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], env=env_for_subprocess(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = proc.stdout.splitlines()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    names = ["fused", "uvm_prefetch", "cache_unlocked", "host_lengths", "rng_devices", "pinned"]
    assert lines == [f"NOT RUN {n}: no CUDA GPU visible (torch.cuda.device_count() == 0)" for n in names]
