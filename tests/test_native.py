"""The C dot interaction (speedups/cpu_kernels.c) computes what TorchRec's InteractionArch does,
and training falls back to torch ops, with a warning, where no C compiler is available."""

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from helpers import with_speedups
from torchrec_cloud import model
from torchrec_cloud.speedups import arches, native


def _fast(f: int) -> arches.DotInteraction:
    arch = InteractionArch(num_sparse_features=f)
    arch.__class__ = arches.DotInteraction
    arch.init_flat_indices()
    return arch


def _reference(f, dense, sparse, grad):
    """TorchRec's own interaction in float64: output and input gradients."""
    dense64 = dense.detach().double().requires_grad_()
    sparse64 = sparse.detach().double().requires_grad_()
    out = InteractionArch(num_sparse_features=f)(dense64, sparse64)
    return (out, *torch.autograd.grad(out, (dense64, sparse64), grad.double()))


@pytest.mark.parametrize("threads", [1, 2])
# The AVX2 forward takes rows in groups of three against four later rows at a time: these
# shapes leave it every remainder (27, 2, 5, 4 and 10 rows; 1-3 rows left after the fours),
# and width 5 takes the generic loop.
@pytest.mark.parametrize(
    "b, f, d", [(33, 26, 64), (9, 26, 128), (17, 3, 5), (5, 1, 64), (6, 4, 8), (7, 3, 16), (3, 9, 24)]
)
def test_native_interaction_matches_torchrec(b, f, d, threads):
    assert native.library() is not None, "the CPU kernels should build on this machine (gcc is here)"
    torch.manual_seed(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dense = torch.randn(b, d, requires_grad=True)
        sparse = torch.randn(b, f, d, requires_grad=True)
        out = _fast(f)(dense, sparse)
        assert out.grad_fn is not None and "Native" in type(out.grad_fn).__name__
        grad = torch.randn_like(out)
        g_dense, g_sparse = torch.autograd.grad(out, (dense, sparse), grad)
    finally:
        torch.set_num_threads(previous)
    ref_out, ref_dense, ref_sparse = _reference(f, dense, sparse, grad)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(g_dense.double(), ref_dense, **tol)
    torch.testing.assert_close(g_sparse.double(), ref_sparse, **tol)
    assert g_sparse.is_contiguous()


def test_strided_inputs_give_the_same_result():
    """Views (a slice of a wider tensor, a transposed layout) are read as their values."""
    torch.manual_seed(1)
    f, d = 4, 8
    wide = torch.randn(6, f + 2, d)
    sparse = wide[:, 1 : f + 1]
    dense = torch.randn(d, 6).t()
    out = _fast(f)(dense, sparse)
    torch.testing.assert_close(out, _fast(f)(dense.contiguous(), sparse.contiguous()))


def test_without_a_compiler_the_interaction_falls_back_with_a_warning(tmp_path, monkeypatch):
    torch.manual_seed(2)
    f, d, b = 26, 64, 16
    dense, sparse = torch.randn(b, d), torch.randn(b, f, d)
    with_kernel = _fast(f)(dense, sparse)

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCHREC_CLOUD_KERNEL_CACHE", str(tmp_path / "cache"))
    native.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU kernels unavailable.*Install a C compiler"):
            assert native.library() is None
        out = _fast(f)(dense.requires_grad_(), sparse)
        assert "Native" not in type(out.grad_fn).__name__
        torch.testing.assert_close(out, with_kernel, rtol=1e-5, atol=1e-4)
    finally:
        native.library.cache_clear()


def test_build_is_cached_per_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHREC_CLOUD_KERNEL_CACHE", str(tmp_path))
    first = native.build()
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


def test_a_failing_compile_says_which_file(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TORCHREC_CLOUD_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(native.NativeBuildError, match=r"(?s)cpu_kernels\.c \(exit 3\).*internal error"):
        native.build()
    assert not any((tmp_path / "cache").iterdir())


def test_interaction_reads_pooled_embeddings_in_rank_order(cpu_kernel_path):
    """Sharded tables deliver their features grouped by rank (0, 2, 4, ..., 1, 3, ...): with
    that column order the interaction gives what it gives on features in order, and the
    tables' gradient lands in the columns they came from."""
    torch.manual_seed(3)
    b, f, d = 12, 6, 16
    in_order = torch.randn(b, f, d)
    by_rank = [0, 2, 4, 1, 3, 5]  # feature held in each arriving column
    arriving = in_order[:, by_rank].clone().requires_grad_()
    order = torch.tensor([by_rank.index(i) for i in range(f)])  # column of each feature
    dense = torch.randn(b, d, requires_grad=True)
    arch = _fast(f)
    out = arch(dense, arriving, order)
    expected = arch(dense.detach(), in_order)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    (g_arriving,) = torch.autograd.grad(out, (arriving,), grad)
    ordered = in_order.clone().requires_grad_()
    (g_ordered,) = torch.autograd.grad(arch(dense.detach(), ordered), (ordered,), grad)
    torch.testing.assert_close(g_arriving, g_ordered[:, by_rank])


@pytest.mark.parametrize("interaction", ["dot", "dcn", "projection"])
def test_sparse_first_forward_equals_torchrec_forward(interaction):
    """Starting the tables first changes the order of work, not the result: TorchRec's own
    DLRM.forward on the same module gives the same logits and gradients."""
    from torchrec.models.dlrm import DLRM
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_cloud.config import parse_job_config

    torch.manual_seed(4)
    args = ["--num_embeddings", "40", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
            "--over_arch_layer_sizes", "16,1", "--interaction", interaction, "--dcn_low_rank_dim", "4",
            "--interaction_branch1_layer_sizes", "16,16", "--interaction_branch2_layer_sizes", "16,16"]  # fmt: skip
    cfg = parse_job_config(args)
    m = with_speedups(model.build_model(cfg.model, dense_device=torch.device("cpu")))
    m.model.sparse_arch.embedding_bag_collection.to_empty(device="cpu")
    for p in m.model.sparse_arch.embedding_bag_collection.parameters():
        torch.nn.init.normal_(p)
    names = m.model.sparse_arch.sparse_feature_names
    b = 5
    ids = torch.randint(0, 40, (len(names) * b,))
    kjt = KeyedJaggedTensor.from_lengths_sync(names, ids, torch.ones(len(names) * b, dtype=torch.long))
    dense = torch.randn(b, cfg.model.num_dense_features)
    ours = m.model(dense, kjt)
    theirs = DLRM.forward(m.model, dense, kjt)
    torch.testing.assert_close(ours, theirs)
    params = [p for p in m.model.parameters() if p.requires_grad]
    g_ours = torch.autograd.grad(ours.sum(), params)
    g_theirs = torch.autograd.grad(theirs.sum(), params)
    for a, c in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, c)


def _tiny_cpu_model(over_arch_layer_sizes: str, b: int = 6):
    """A built CPU model (26 tables of 40 rows x dim 8, dense arch 16,8), its tables drawn from
    a normal distribution, a batch of b samples for it, and its trainable parameters."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_cloud.config import parse_job_config

    cfg = parse_job_config(["--num_embeddings", "40", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
                            "--over_arch_layer_sizes", over_arch_layer_sizes])  # fmt: skip
    m = with_speedups(model.build_model(cfg.model, dense_device=torch.device("cpu")))
    m.model.sparse_arch.embedding_bag_collection.to_empty(device="cpu")
    for p in m.model.sparse_arch.embedding_bag_collection.parameters():
        torch.nn.init.normal_(p)
    names = m.model.sparse_arch.sparse_feature_names
    kjt = KeyedJaggedTensor.from_lengths_sync(names, torch.randint(0, 40, (len(names) * b,)),
                                              torch.ones(len(names) * b, dtype=torch.long))  # fmt: skip
    dense = torch.randn(b, cfg.model.num_dense_features)
    return m, dense, kjt, [p for p in m.model.parameters() if p.requires_grad]


@pytest.mark.parametrize("b, f, d, pad_to, padded", [(33, 26, 64, 8, 416), (7, 3, 5, 16, 16), (4, 2, 4, 8, 8)])
def test_padded_rows_hold_the_same_values_and_the_pad_takes_no_gradient(b, f, d, pad_to, padded):
    """With pad_to, each output row of the C kernel is followed by zeros up to the padded
    width; the values and both input gradients are bitwise those of unpadded rows, whatever
    the gradient of the pad columns holds."""
    assert native.library() is not None, "the CPU kernels should build on this machine (gcc is here)"
    torch.manual_seed(5)
    width = d + (f + 1) * f // 2
    dense = torch.randn(b, d, requires_grad=True)
    sparse = torch.randn(b, f, d, requires_grad=True)
    plain = arches._NativeDotInteractionFn.apply(dense, sparse, None)
    out = arches._NativeDotInteractionFn.apply(dense, sparse, None, pad_to)
    assert plain.shape == (b, width) and out.shape == (b, padded)
    assert torch.equal(out[:, :width], plain)
    assert torch.equal(out[:, width:], torch.zeros(b, padded - width))
    grad = torch.randn(b, padded) * 100  # the pad's gradient is noise the kernel must skip
    g_padded = torch.autograd.grad(out, (dense, sparse), grad)
    g_plain = torch.autograd.grad(plain, (dense, sparse), grad[:, :width].contiguous())
    for a, c in zip(g_padded, g_plain):
        assert torch.equal(a, c)


def test_cpu_model_feeds_the_over_arch_padded_rows_with_the_same_result(cpu_kernel_path):
    """On a CPU the C kernel's dot interaction hands the over arch's first layer rows padded to
    a multiple of 8, which it takes with a padded weight (on torch ops, the rows as they are):
    logits and every parameter's gradient equal those of the unpadded layer, and its
    parameters keep their shapes."""
    torch.manual_seed(6)
    m, dense, kjt, params = _tiny_cpu_model("16,1")
    b = dense.shape[0]
    first_over = next(x for x in m.model.over_arch.modules() if isinstance(x, torch.nn.Linear))
    width = 8 + 27 * 26 // 2  # 359
    assert type(first_over) is arches.AlignedLinear and first_over.weight.shape == (16, width)
    assert m.model.inter_arch.pad_to == 8
    seen = []  # what the layer (its Perceptron: linear and ReLU) is handed
    m.model.over_arch.model[0]._mlp[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    padded = m.model(dense, kjt)
    g_padded = torch.autograd.grad(padded.sum(), params)
    m.model.inter_arch.pad_to = 1
    plain = m.model(dense, kjt)
    g_plain = torch.autograd.grad(plain.sum(), params)
    assert seen == [360 if native.library() is not None else width, width]
    # Only rows from the interaction are taken padded: the dense arch's first layer (13 inputs)
    # still rejects 16 columns instead of reading them with a padded weight.
    first_dense = m.model.dense_arch.model._mlp[0]._linear
    assert type(first_dense) is arches.AlignedLinear
    for layer in (first_dense, m.model.dense_arch.model._mlp[0]):
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            layer(torch.randn(b, 16))
    torch.testing.assert_close(padded, plain)
    for a, c in zip(g_padded, g_plain):
        assert a.shape == c.shape
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b, i, o", [(33, 16, 13), (5, 7, 3), (64, 24, 32), (9, 40, 17)])
def test_relu_layer_matches_torch(b, i, o, threads):
    """The MLP layer with its bias and ReLU in C gives torch's relu(linear(x)) and its
    gradients, including where the pre-activation is exactly zero (no gradient, as
    threshold_backward) or NaN (stays NaN, and passes the gradient, as torch's ops do)."""
    assert native.library() is not None, "the CPU kernels should build on this machine (gcc is here)"
    from torchrec.modules.mlp import Perceptron

    torch.manual_seed(7)
    layer = Perceptron(i, o, activation=torch.relu)
    with torch.no_grad():
        layer._linear.bias[0] = 0.0
        layer._linear.bias[1] = float("nan")
    x = torch.randn(b, i)
    x[:2] = 0.0  # rows whose pre-activation is the bias: exactly 0 in column 0, NaN in column 1
    x.requires_grad_()
    grad = torch.randn(b, o)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for cls in (Perceptron, arches.ReLUPerceptron):
            layer.__class__ = cls
            y = layer(x)
            results.append((y, *torch.autograd.grad(y, (x, *layer.parameters()), grad)))
    finally:
        torch.set_num_threads(previous)
    (y_ref, *g_ref), (y, *g) = results
    assert "LinearReLU" in type(y.grad_fn).__name__
    torch.testing.assert_close(y, y_ref, equal_nan=True)
    assert torch.equal(y[:2, 0], torch.zeros(2)) and y[:, 1].isnan().all()
    for a, c in zip(g, g_ref):
        torch.testing.assert_close(a, c, equal_nan=True)


def test_cpu_model_layers_use_the_c_relu_with_the_same_result(cpu_kernel_path):
    """Every MLP layer with a ReLU in the built CPU model runs through the C bias and ReLU
    (with the C kernels), and the logits and every parameter's gradient equal TorchRec's
    layers'."""
    from torchrec.modules.mlp import Perceptron

    torch.manual_seed(8)
    m, dense, kjt, params = _tiny_cpu_model("16,8,1")
    layers = [x for x in m.model.modules() if isinstance(x, Perceptron)]
    assert len(layers) == 4 and all(type(x) is arches.ReLUPerceptron for x in layers)
    kinds = []
    for layer in layers:
        layer.register_forward_hook(lambda mod, args, out: kinds.append(type(out.grad_fn).__name__))
    fused = m.model(dense, kjt)
    g_fused = torch.autograd.grad(fused.sum(), params)
    for layer in layers:
        layer.__class__ = Perceptron
    plain = m.model(dense, kjt)
    g_plain = torch.autograd.grad(plain.sum(), params)
    c_path = native.library() is not None
    assert [("LinearReLU" in k) for k in kinds[:4]] == [c_path] * 4
    torch.testing.assert_close(fused, plain)
    for a, c in zip(g_fused, g_plain):
        torch.testing.assert_close(a, c)
