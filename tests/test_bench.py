"""The bench command's contract: its last line is one JSON object with the figures."""

import json

from helpers import PYTHON, explain, run, shm_usable

KEYS = (
    "bound_samples_per_s", "ours_samples_per_s", "ours_2rank_samples_per_s",
    "handwritten_samples_per_s", "ours_peak_rss_mb", "handwritten_peak_rss_mb",
)  # fmt: skip


def test_bench_json_last_line_has_every_figure():
    # Tiny steps and tables: this checks the plumbing, the numbers are measured by `make bench`.
    proc = run([PYTHON, "-m", "torchrec_cloud", "bench", "--json", "--steps", "2", "--warmup", "1",
                "--batch_size", "256", "--", "--num_embeddings", "1000"])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert result[key] > 0, (key, result)
    assert abs(result["ours_vs_bound"] - result["ours_samples_per_s"] / result["bound_samples_per_s"]) < 1e-9
    # Ours is the mean of two measurements, either side of the 2-rank one.
    first, last = result["ours_samples_per_s_runs"]
    assert first > 0 and last > 0 and abs(result["ours_samples_per_s"] - (first + last) / 2) < 1e-6
    # The bound's matmul rate: measured in each 1-rank process just before and after its
    # timed steps; the separate bound runs at start and end are reported beside it.
    around = result["matmul_gflops_alongside_ours"]
    assert len(around) == 4 and min(around) > 0 and abs(result["matmul_gflops"] - sum(around) / 4) < 1e-9
    assert result["matmul_gflops_start"] > 0 and result["matmul_gflops_end"] > 0
    assert abs(result["bound_samples_per_s"] - result["matmul_gflops"] * 1e9 / result["flops_per_sample"]) < 1e-6
    # FLOPs per sample of the quickstart dense compute: MLPs + interaction, fwd + bwd.
    assert 2.5e6 < result["flops_per_sample"] < 4.0e6
    assert "hand-written PyTorch" in proc.stdout
    # Which CPU step was measured: here a compiler is present, so the C kernels.
    assert result["cpu_kernels"] == "native" and "CPU kernels: native" in proc.stdout
    # And how the 2 ranks exchanged embeddings and gradients: through /dev/shm where it can.
    expected = "shared memory + gloo" if shm_usable() else "gloo"
    assert result["ours_2rank_collectives"] == expected, result
    assert f"(RSS per rank; {expected})" in proc.stdout


def test_precision_defaults_to_fp32_and_rejects_unknown_values():
    import argparse

    import pytest
    import torch

    from torchrec_cloud import bench

    parser = bench.add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args([]).precision == "fp32"
    before = torch.backends.cuda.matmul.allow_tf32
    with bench.precision_context("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    assert torch.backends.cuda.matmul.allow_tf32 == before
    with bench.precision_context("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="--precision"):
        bench.precision_context("fp16", torch.device("cpu"))


def test_dot_interaction_trains_under_bf16_autocast():
    # Under autocast the MLP output is bfloat16 and the pooled embeddings float32; the
    # interaction's hand-written backward must cope and give the float32 gradients back.
    import torch
    from torchrec.models.dlrm import InteractionArch

    from torchrec_cloud.speedups.arches import DotInteraction

    torch.manual_seed(0)
    arch = InteractionArch(num_sparse_features=5)
    arch.__class__ = DotInteraction
    arch.init_flat_indices()
    dense = torch.randn(16, 8, requires_grad=True)
    sparse = torch.randn(16, 5, 8, requires_grad=True)
    weight = torch.randn(8 + 15)

    def grads(autocast: bool):
        dense.grad = sparse.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            d = dense.to(torch.bfloat16) if autocast else dense
            out = arch(d, sparse)
        (out.float() @ weight).sum().backward()
        return dense.grad.clone(), sparse.grad.clone()

    ref, low = grads(False), grads(True)
    assert low[1].dtype == torch.float32
    for r, g in zip(ref, low):
        assert (g - r).norm() / r.norm() < 3e-2


def test_bench_worker_runs_in_bf16():
    proc = run([PYTHON, "-m", "torchrec_cloud", "bench", "--worker", "ours", "--steps", "2", "--warmup", "1",
                "--precision", "bf16", "--", "--synthetic", "random", "--batch_size", "64", "--num_embeddings", "100",
                "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
                "--no-progress", "--no-tensorboard"])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1][len("BENCH "):])
    assert result["precision"] == "bf16" and result["samples_per_s"] > 0
    # A batch of its own for each of the 1 + 2 steps (and the pipeline's look-ahead), as
    # training reads them: a few cycled batches would keep a UVM-cached table's ids cached.
    assert result["batches"] == 1 + 2 + 4
