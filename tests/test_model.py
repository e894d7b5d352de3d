"""Model building: interactions, meta-device tables, fused optimizer, the LR schedule."""

import pytest
import torch
from torchrec.models import dlrm

from helpers import with_speedups
from torchrec_cloud.config import OptimizerConfig, parse_job_config
from torchrec_cloud.data.synthetic import SyntheticSource
from torchrec_cloud.model import build_model, table_configs
from torchrec_cloud.optim import WarmupPolyDecay

SMALL = ["--num_embeddings", "50", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
         "--over_arch_layer_sizes", "16,1", "--batch_size", "32"]  # fmt: skip


@pytest.mark.parametrize("interaction, cls", [("dot", "DLRM"), ("dcn", "DLRM_DCN"), ("projection", "DLRM_Projection")])
def test_interactions_build_with_tables_on_meta(interaction, cls):
    extra = ["--dcn_low_rank_dim", "4"] if interaction == "dcn" else []
    extra += ["--interaction_branch1_layer_sizes", "16,16", "--interaction_branch2_layer_sizes", "16,16"]
    cfg = parse_job_config(SMALL + ["--interaction", interaction] + extra)
    model = build_model(cfg.model, dense_device=torch.device("cpu"))
    assert type(model.model) is getattr(dlrm, cls)  # TorchRec's, until the speed-ups layer converts it
    with_speedups(model)
    # TorchRec's class of that interaction, with the tables' lookup started first (arches._SparseFirst)
    assert type(model.model).__name__ == f"SparseFirst{cls}"
    assert type(model.model).__bases__[-1] is getattr(dlrm, cls)
    tables = list(model.model.sparse_arch.embedding_bag_collection.parameters())
    assert len(tables) == 26 and all(t.is_meta for t in tables)
    dense = [p for n, p in model.named_parameters() if "sparse_arch" not in n]
    assert dense and not any(p.is_meta for p in dense)


def test_table_configs_follow_num_embeddings_per_feature():
    sizes = ",".join(str(10 + i) for i in range(26))
    cfg = parse_job_config(SMALL + ["--num_embeddings_per_feature", sizes])
    rows = [t.num_embeddings for t in table_configs(cfg.model)]
    assert rows == [10 + i for i in range(26)]
    assert table_configs(cfg.model)[3].feature_names == ["cat_3"]


def test_warmup_then_polynomial_decay():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=4, decay_start_step=6, decay_steps=4, decay_power=2.0, lr_end=0.0)
    sched = WarmupPolyDecay(opt, cfg)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:7] == pytest.approx([1.0, 1.0, 1.0])
    assert lrs[7:11] == pytest.approx([(1 - k / 4) ** 2 for k in range(1, 5)])
    assert lrs[11] == pytest.approx(0.0)


def test_synthetic_data_is_deterministic_and_rank_sliced():
    cfg = parse_job_config(SMALL)
    a0 = list(SyntheticSource(cfg, rank=0, world_size=2).train_batches(0))
    a0_again = list(SyntheticSource(cfg, rank=0, world_size=2).train_batches(0))
    a1 = list(SyntheticSource(cfg, rank=1, world_size=2).train_batches(0))
    assert torch.equal(a0[0].labels, a0_again[0].labels)
    assert torch.equal(a0[0].sparse_features.values(), a0_again[0].sparse_features.values())
    assert not torch.equal(a0[0].dense_features, a1[0].dense_features)
    # Rank 1's first batch is global batch 1, which a 1-rank run sees second.
    single = list(SyntheticSource(cfg, rank=0, world_size=1).train_batches(0))
    assert torch.equal(single[1].dense_features, a1[0].dense_features)
    kjt = a0[0].sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert int(kjt.values().max()) < 50 and int(kjt.values().min()) >= 0


def test_eval_split_is_the_same_for_any_world_size():
    cfg = parse_job_config(SMALL + ["--num_eval_batches", "3"])

    def rows(world):
        labels = []
        for rank in range(world):
            for batch, valid in SyntheticSource(cfg, rank, world).eval_batches("val"):
                labels.append(batch.labels[:valid])
        return torch.sort(torch.cat(labels)).values, sum(len(x) for x in labels)

    one, n1 = rows(1)
    two, n2 = rows(2)
    assert n1 == n2 == 3 * 32
    assert torch.equal(one, two)
    counts = [len(list(SyntheticSource(cfg, r, 2).eval_batches("val"))) for r in range(2)]
    assert counts[0] == counts[1]  # padding keeps ranks in step


def test_planted_labels_follow_the_teacher_and_random_ones_do_not():
    cfg = parse_job_config(SMALL + ["--num_eval_batches", "20"])
    assert SyntheticSource(cfg, 0, 1).bayes_auc() > 0.75
    cfg_random = parse_job_config(SMALL + ["--synthetic", "random"])
    src = SyntheticSource(cfg_random, 0, 1)
    labels = torch.cat([b.labels for b in src.train_batches(0)])
    assert 0.4 < float(labels.mean()) < 0.6


def test_fast_arches_match_torchrec_forward_and_backward():
    from torchrec.models.dlrm import InteractionArch

    from torchrec_cloud.speedups.arches import DotInteraction

    torch.manual_seed(0)
    f, d, b = 5, 4, 7
    ref = InteractionArch(num_sparse_features=f).double()
    fast = InteractionArch(num_sparse_features=f).double()
    fast.__class__ = DotInteraction
    fast.init_flat_indices()
    dense = torch.randn(b, d, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(b, f, d, dtype=torch.float64, requires_grad=True)
    out_ref = ref(dense, sparse)
    out_fast = fast(dense, sparse)
    assert torch.allclose(out_ref, out_fast)
    grad = torch.randn_like(out_ref)
    g_ref = torch.autograd.grad(out_ref, (dense, sparse), grad)
    g_fast = torch.autograd.grad(out_fast, (dense, sparse), grad)
    for a, c in zip(g_ref, g_fast):
        assert torch.allclose(a, c)
    assert torch.autograd.gradcheck(lambda x, y: fast(x, y), (dense, sparse))


def test_built_model_keeps_torchrec_parameter_names():
    cfg = parse_job_config(SMALL)
    model = build_model(cfg.model, dense_device=torch.device("cpu"))
    names = [(n, p.shape) for n, p in model.named_parameters()]
    assert "model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight" in dict(names)
    assert any(n.startswith("model.over_arch.") for n, _ in names)
    # The speed-ups layer changes classes, not parameters: checkpoints load either way.
    assert [(n, p.shape) for n, p in with_speedups(model).named_parameters()] == names


def test_misaligned_first_layers_pad_on_gpu_only_and_keep_their_parameters():
    # 13 dense features and the 415-wide dot-interaction output: padded to 16 and 416 on a
    # GPU (fast cuBLAS kernels), the same nn.Linear on a CPU for inputs of in_features columns
    # (test_native.py: the CPU interaction's rows that arrive padded); shapes and names unchanged.
    from torchrec_cloud.speedups.arches import AlignedLinear, aligned_linear

    cfg = parse_job_config(["--embedding_dim", "64", "--num_embeddings", "50"])
    dlrm = with_speedups(build_model(cfg.model, dense_device=torch.device("cpu"))).model
    first_dense = dlrm.dense_arch.model._mlp[0]._linear
    first_over = next(m for m in dlrm.over_arch.modules() if isinstance(m, torch.nn.Linear))
    assert type(first_dense) is AlignedLinear and first_dense.weight.shape == (512, 13)
    assert type(first_over) is AlignedLinear and first_over.weight.shape == (512, 64 + 26 * 27 // 2)

    torch.manual_seed(0)
    x = torch.randn(32, 13, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 13, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64)
    out = aligned_linear(x, w, b)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(out, ref)
    (gx, gw) = torch.autograd.grad(out.sum(), (x, w))
    (rx, rw) = torch.autograd.grad(ref.sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(first_dense(x.float()), torch.nn.functional.linear(x.float(), first_dense.weight, first_dense.bias))
