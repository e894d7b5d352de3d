"""The CPU row-wise Adagrad update does what fbgemm's own kernel does, inside a TBE and in training."""

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
from torchrec_cloud import cpu_rowwise_adagrad


@pytest.fixture
def restore_fbgemm():
    yield
    cpu_rowwise_adagrad.uninstall()


@pytest.mark.parametrize(
    "max_bag, weighted, pooling",
    [(1, False, PoolingMode.SUM), (4, False, PoolingMode.SUM), (3, True, PoolingMode.SUM), (3, False, PoolingMode.MEAN)],
    ids=["one-hot", "multi-hot with empty bags", "weighted", "mean pooling"],
)
def test_update_matches_fbgemm_kernel(restore_fbgemm, cpu_kernel_path, max_bag, weighted, pooling):
    torch.manual_seed(0)
    sizes, dim, batch = [50, 30, 40], 8, 16
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in sizes]
    ours = SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.3, eps=1e-3, pooling_mode=pooling
    )
    ref = copy.deepcopy(ours)
    for _ in range(3):
        lengths = torch.randint(0 if max_bag > 1 else 1, max_bag + 1, (len(sizes) * batch,))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        # few distinct ids per table, so rows repeat within and across bags
        ids = torch.randint(0, 5, (int(lengths.sum()),))
        weights = torch.rand(ids.numel()) if weighted else None
        grad = torch.randn(batch, len(sizes) * dim)

        cpu_rowwise_adagrad.uninstall()
        out_ref = ref(ids, offsets, per_sample_weights=weights)
        out_ref.backward(grad)
        cpu_rowwise_adagrad.install()
        out = ours(ids, offsets, per_sample_weights=weights)
        assert out.grad_fn is not None and "RowwiseAdagrad" in type(out.grad_fn).__name__
        out.backward(grad)
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
        cpu_rowwise_adagrad.rowwise_adagrad_update(
            weights, momentum, torch.tensor([0, 10]), ids, offsets, torch.randn(2, 8), lr=0.1, eps=1e-8
        )
    assert torch.equal(weights, before) and not momentum.any()


def test_eval_without_grad_goes_to_fbgemm(restore_fbgemm):
    specs = [(20, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)] * 2
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    cpu_rowwise_adagrad.install()
    with torch.no_grad():
        out = tbe(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4]))
    assert out.shape == (2, 8) and out.grad_fn is None


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
