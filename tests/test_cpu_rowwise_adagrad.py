"""The CPU row-wise Adagrad update (speedups/rowwise_adagrad.py) does what fbgemm's own kernel
does, inside a TBE and in training."""

import copy

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from helpers import PYTHON, TINY, evals, explain, read_metrics, run
from torchrec_cloud.speedups import native
from torchrec_cloud.speedups import rowwise_adagrad


@pytest.mark.parametrize(
    "max_bag, weighted, pooling, dim",
    [
        (1, False, PoolingMode.SUM, 64),
        (4, False, PoolingMode.SUM, 8),
        (3, True, PoolingMode.SUM, 8),
        (3, False, PoolingMode.MEAN, 128),
        (40, True, PoolingMode.SUM, 8),
    ],
    ids=["one-hot", "multi-hot with empty bags", "weighted", "mean pooling", "long weighted bags"],
)
def test_update_matches_fbgemm_kernel(cpu_kernel_path, max_bag, weighted, pooling, dim):
    """Forward (the C lookup) and update (the C row-wise Adagrad) against fbgemm's CPU kernels."""
    torch.manual_seed(0)
    sizes, batch = [50, 30, 40], 16
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in sizes]
    ours = SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.3, eps=1e-3, pooling_mode=pooling
    )
    ref = copy.deepcopy(ours)
    assert rowwise_adagrad.install(ours) == 1  # this TBE only: ref stays fbgemm's
    for step in range(3):
        lengths = torch.randint(0 if max_bag > 1 else 1, max_bag + 1, (len(sizes) * batch,))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        # few distinct ids per table, so rows repeat within and across bags
        ids = torch.randint(0, 5, (int(lengths.sum()),))
        weights = torch.rand(ids.numel()) if weighted else None
        grad = torch.randn(batch, len(sizes) * dim)

        out_ref = ref(ids, offsets, per_sample_weights=weights)
        assert "RowwiseAdagrad" not in type(out_ref.grad_fn).__name__
        out_ref.backward(grad)
        out = ours(ids, offsets, per_sample_weights=weights)
        assert out.grad_fn is not None and "RowwiseAdagrad" in type(out.grad_fn).__name__
        out.backward(grad)
        if step == 0:  # the same rows summed in the same order: bit for bit
            assert torch.equal(out, out_ref), (out - out_ref).abs().max()
        else:  # after the updates, which round differently
            torch.testing.assert_close(out, out_ref)

    torch.testing.assert_close(ours.weights_host, ref.weights_host)
    torch.testing.assert_close(ours.momentum1_host, ref.momentum1_host)
    assert float(ref.momentum1_host.abs().sum()) > 0  # the optimizer did run


def test_an_id_outside_the_tables_is_refused_before_any_row_changes(cpu_kernel_path):
    """fbgemm's forward checks each table's bounds; the update still never writes outside the
    tables' buffer (here two features of 10 rows, and the second feature's id 15 is row 25)."""
    torch.manual_seed(0)
    weights, momentum = torch.randn(20, 4), torch.zeros(20)
    before = weights.clone()
    ids = torch.tensor([3, 1, 15, 2])  # bags feature-major: two per feature, one id each
    offsets = torch.arange(5)
    with pytest.raises(IndexError):
        rowwise_adagrad.rowwise_adagrad_update(
            weights, momentum, torch.tensor([0, 10]), ids, offsets, torch.randn(2, 8), lr=0.1, eps=1e-8
        )
    assert torch.equal(weights, before) and not momentum.any()


@pytest.mark.parametrize("offsets", [[0, 1, 2, 3, 3], [0, 2, 1, 3, 4], [1, 2, 3, 4, 4]], ids=["short", "decreasing", "from 1"])
def test_offsets_that_do_not_cover_the_ids_are_refused_before_any_row_changes(cpu_kernel_path, offsets):
    torch.manual_seed(0)
    weights, momentum = torch.randn(20, 4), torch.zeros(20)
    before = weights.clone()
    with pytest.raises(ValueError, match="the 5 bag offsets must run from 0 to the 4 ids"):
        rowwise_adagrad.rowwise_adagrad_update(
            weights, momentum, torch.tensor([0, 10]), torch.tensor([3, 1, 5, 2]), torch.tensor(offsets),
            torch.randn(2, 8), lr=0.1, eps=1e-8,
        )  # fmt: skip
    assert torch.equal(weights, before) and not momentum.any()


def test_lookup_equals_fbgemm_forward_bit_for_bit_and_refuses_ids_outside_the_tables():
    """Weighted bags with mean pooling (both scalings) of up to 100 ids, against fbgemm's CPU
    forward. (fbgemm's CPU *update* for that combination is not the gradient of its forward,
    so the update test above leaves it out.)"""
    assert native.library() is not None, "the CPU kernels should build on this machine (gcc is here)"
    torch.manual_seed(0)
    sizes, dim, batch = [500, 300], 64, 32
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in sizes]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, pooling_mode=PoolingMode.MEAN)
    lengths = torch.randint(0, 101, (len(sizes) * batch,))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.randint(0, 300, (int(lengths.sum()),))
    weights = torch.rand(ids.numel())
    with torch.no_grad():  # fbgemm's own forward: the TBE is not installed
        ref = tbe(ids, offsets, per_sample_weights=weights)
    flat = tbe.weights_host.view(-1, dim)
    out = rowwise_adagrad.pooled_lookup(flat, torch.tensor([0, 500]), ids, offsets, weights, mean_pooling=True)
    assert torch.equal(out, ref), (out - ref).abs().max()

    ids = torch.tensor([3, 1, 301, 2])  # two features of 500 and 300 rows; 301 of the second is row 801
    with pytest.raises(IndexError, match="outside the 800 rows"):
        rowwise_adagrad.pooled_lookup(flat, torch.tensor([0, 500]), ids, torch.arange(5))


def test_eval_without_grad_goes_to_fbgemm():
    specs = [(20, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)] * 2
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    rowwise_adagrad.install(tbe)
    with torch.no_grad():
        out = tbe(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4]))
    assert out.shape == (2, 8) and out.grad_fn is None
    rowwise_adagrad.uninstall(tbe)
    out = tbe(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4]))
    assert "RowwiseAdagrad" not in type(out.grad_fn).__name__  # fbgemm's again


def test_training_with_either_update_gives_the_same_model(tmp_path):
    finals = {}
    for update in ("torch", "fbgemm"):
        out = tmp_path / update
        args = ["--synthetic", "planted", *TINY, "--learning_rate", "0.1", "--cpu_embedding_update", update]
        proc = run([PYTHON, "-m", "torchrec_cloud", "train", *args, "--output_dir", str(out)])
        assert proc.returncode == 0, explain(proc)
        finals[update] = evals(read_metrics(out), "test")[-1]
    fast, ref = finals["torch"], finals["fbgemm"]
    assert fast["auc"] == pytest.approx(ref["auc"], abs=1e-4), (fast, ref)
    assert fast["logloss"] == pytest.approx(ref["logloss"], rel=1e-4), (fast, ref)
