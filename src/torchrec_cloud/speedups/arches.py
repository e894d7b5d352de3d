"""Cheaper versions of TorchRec's DLRM arches and layers, with the same arithmetic and parameters.

They subclass TorchRec's modules and keep their attributes, so parameter names (and so
checkpoints) are unchanged; :func:`convert` swaps a built DLRM's modules for them, in
place, before it is sharded (``Speedups.apply_to_model``)::

    applied = convert(model.model, on_cpu=True)   # ["pooled_in_place", "tables_first", ...]

- ``tables_first`` (:class:`SparseFirstDLRM` and its DCN and projection kin): DLRM's
  forward with the tables' lookup started before the dense MLP;
- ``pooled_in_place`` (:class:`FlatSparseArch`): the pooled embeddings handed to the
  interaction as they lie, with the order to read them in;
- ``dot_interaction`` (:class:`DotInteraction`): only the pairs, with a one-product
  backward; on a CPU in ``cpu_kernels.c``;
- ``aligned_first_layers`` (:class:`AlignedLinear`): an MLP's first layer whose input
  width is not a multiple of 8 pads it (GPU), or takes the interaction's rows padded (CPU);
- ``bias_relu`` (:class:`ReLUPerceptron`, CPU only): the layers' bias and ReLU in C.

Each keeps TorchRec's code path where it does not apply (another dtype, autocast, no C
kernels). The rewritten forwards are pinned against TorchRec's in :mod:`torchrec_cloud.compat`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, InteractionArch, SparseArch
from torchrec.modules.mlp import Perceptron

from torchrec_cloud.speedups import native


def convert(dlrm: DLRM, on_cpu: bool, skip: frozenset[str] = frozenset()) -> list[str]:
    """Swap ``dlrm``'s arches and layers for this module's, in place, leaving out the
    speed-ups named in ``skip``; the names of those applied. ``tables_first`` needs
    ``pooled_in_place`` (it reads the pooled embeddings through :meth:`FlatSparseArch.keyed`)."""
    applied = []
    if "pooled_in_place" not in skip:
        dlrm.sparse_arch.__class__ = FlatSparseArch
        applied.append("pooled_in_place")
        if "tables_first" not in skip:
            dlrm.__class__ = _SPARSE_FIRST[type(dlrm)]
            applied.append("tables_first")
    if type(dlrm.inter_arch) is InteractionArch and "dot_interaction" not in skip:
        dlrm.inter_arch.__class__ = DotInteraction
        dlrm.inter_arch.init_flat_indices()
        applied.append("dot_interaction")
    for arch in (dlrm.dense_arch, dlrm.over_arch):
        for layer in arch.modules() if on_cpu and "bias_relu" not in skip else ():
            if type(layer) is Perceptron and layer._activation_fn is torch.relu and layer._linear.bias is not None:
                layer.__class__ = ReLUPerceptron
                if "bias_relu" not in applied:
                    applied.append("bias_relu")
        first = next(m for m in arch.modules() if isinstance(m, torch.nn.Linear))
        if first.in_features % ALIGN and "aligned_first_layers" not in skip:
            first.__class__ = AlignedLinear
            if arch is dlrm.over_arch and isinstance(dlrm.inter_arch, DotInteraction):
                dlrm.inter_arch.pad_to = ALIGN  # it hands the over arch rows it takes as they are
                first.takes_padded_rows = True
            if "aligned_first_layers" not in applied:
                applied.append("aligned_first_layers")
    return applied


ALIGN = 8


def aligned_width(features: int) -> int:
    """``features`` rounded up to a multiple of ``ALIGN``."""
    return features + (-features % ALIGN)


def aligned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   x_padded: bool = False) -> torch.Tensor:  # fmt: skip
    """``F.linear`` with the inner dimension zero-padded to a multiple of ``ALIGN``; with
    ``x_padded``, x already has that many columns (the extra ones zero) and only the weight
    is padded."""
    if not x_padded:
        x = torch.nn.functional.pad(x, (0, aligned_width(weight.shape[1]) - weight.shape[1]))
    return torch.nn.functional.linear(x, padded_weight(weight), bias)


def padded_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with zero columns up to ``aligned_width`` of its inputs (an autograd op)."""
    return torch.nn.functional.pad(weight, (0, aligned_width(weight.shape[1]) - weight.shape[1]))


class AlignedLinear(torch.nn.Linear):
    """The first layer of an MLP whose input width (13 dense features; 415 or 479 from the
    dot interaction) is not a multiple of 8.

    cuBLAS's Hopper/Ampere tensor-core GEMMs need 16-byte aligned rows; with odd rows it
    falls back to slow Turing-era kernels (on an H100 the first top-MLP layer then took most
    of the dense time). On a GPU the input and weight are zero-padded per call (same result).

    On a CPU, MKL also runs the GEMMs of misaligned rows (415 floats) slower than of aligned
    ones (416). The dot interaction there writes its rows already padded with zeros
    (``DotInteraction.pad_to``), and only the weight is padded here, which costs less than
    the misaligned GEMMs. Only the layer after that interaction (``takes_padded_rows``)
    accepts padded rows; any other input goes through nn.Linear, which rejects a wrong width.
    """

    takes_padded_rows = False

    def takes_padded(self, x: torch.Tensor) -> bool:
        """Whether x is the interaction's padded rows, which this CPU layer takes as they are."""
        return self.takes_padded_rows and x.shape[-1] == aligned_width(self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not x.is_cuda:
            if self.takes_padded(x):
                return aligned_linear(x, self.weight, self.bias, x_padded=True)
            return super().forward(x)
        if torch.is_autocast_enabled("cuda"):  # pad the half-width copy autocast makes anyway
            x = x.to(torch.get_autocast_dtype("cuda"))
        return aligned_linear(x, self.weight, self.bias)


class ReLUPerceptron(Perceptron):
    """TorchRec's Perceptron with a ReLU, whose bias and ReLU run on a CPU in
    ``cpu_kernels.c`` around torch's matmuls (:class:`_LinearReLUFn`).

    nn.Linear's addmm first copies the bias into every output row and the GEMM then adds to
    them; the ReLU is another pass, and its backward and the bias's gradient two more. Here
    the GEMM writes a fresh output, one pass adds the bias and applies the ReLU in place, and
    one pass masks the gradient and sums its columns: two passes over the activations
    instead of four. Elsewhere (GPU, autocast, another dtype, no C kernels) it is TorchRec's
    layer.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        linear = self._linear
        if (
            input.is_cuda
            or input.dim() != 2
            or input.dtype != torch.float32
            or linear.weight.dtype != torch.float32
            or torch.is_autocast_enabled("cpu")
            or native.library() is None
        ):
            return super().forward(input)
        weight = linear.weight
        if input.shape[1] != linear.in_features:
            if not (isinstance(linear, AlignedLinear) and linear.takes_padded(input)):
                return super().forward(input)  # nn.Linear's shape error
            weight = padded_weight(weight)
        return _LinearReLUFn.apply(input, weight, linear.bias)


class _LinearReLUFn(torch.autograd.Function):
    """relu(x @ weight.T + bias) for float32 on CPU, with the same gradients as torch's ops
    (the ReLU passes the gradient where its output is above zero, as threshold_backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        y = torch.mm(x, weight.t())
        native.library().bias_relu_forward(y.data_ptr(), bias.data_ptr(), y.shape[0], y.shape[1])
        ctx.save_for_backward(x, weight, y)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        x, weight, y = ctx.saved_tensors
        rows, cols = y.shape
        grad_y = grad_y.float()
        if grad_y.stride(1) != 1 or grad_y.stride(0) < cols:
            grad_y = grad_y.contiguous()
        grad, grad_bias = torch.empty_like(y), y.new_empty(cols)
        if native.library().relu_bias_backward(
            grad_y.data_ptr(), grad_y.stride(0), y.data_ptr(), grad.data_ptr(), grad_bias.data_ptr(), rows, cols
        ):  # fmt: skip
            raise MemoryError(f"relu_bias_backward: no memory for the bias gradient's partial sums ({cols} columns)")
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # MKL runs [out, batch] @ [batch, in] with a narrow input (the dense arch's 13
            # features) much slower than the transposed product.
            grad_weight = (x.t() @ grad).t().contiguous() if x.shape[1] <= 32 else grad.t() @ x
        return grad_x, grad_weight, grad_bias


class FlatSparseArch(SparseArch):
    """SparseArch without the split-and-concatenate of the pooled embeddings.

    TorchRec's version turns the KeyedTensor into a dict of 26 views and concatenates them
    back, a full copy forward and backward. The values are already the [B, F*D] matrix it
    rebuilds, with the features in key order: feature order in a world of one, grouped by
    rank when the tables are sharded. :meth:`keyed` hands them over as they are, with the
    order to read them in, and the interaction reads them in place.
    """

    def keyed(self, pooled) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """([B, F, D] in key order, the key-order column of each feature or None if the same)."""
        values = pooled.values().reshape(-1, self.F, self.D)
        # The train pipeline traces the forward only to find the sharded module's inputs;
        # the key check is plain Python on real steps.
        if torch.fx._symbolic_trace.is_fx_tracing():
            return values, None
        keys = tuple(pooled.keys())
        orders = self.__dict__.setdefault("_orders", {})  # a plain cache, not module state
        if (keys, values.device) not in orders:
            if sorted(keys) != sorted(self.sparse_feature_names):
                raise ValueError(f"pooled embeddings have keys {list(keys)}, expected {self.sparse_feature_names}")
            column = {name: i for i, name in enumerate(keys)}
            order = torch.tensor([column[name] for name in self.sparse_feature_names], device=values.device)
            orders[keys, values.device] = None if keys == tuple(self.sparse_feature_names) else order
        return values, orders[keys, values.device]

    def forward(self, features):  # type: ignore[override]
        values, order = self.keyed(self.embedding_bag_collection(features))
        return in_feature_order(values, order)


def in_feature_order(values: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    return values if order is None else values.index_select(1, order)


class _SparseFirst:
    """DLRM's forward with the tables first.

    TorchRec's DLRM runs the dense MLP, then the tables, and waits for their pooled
    embeddings at once. Sharded over several ranks, the tables' output travels in an
    all-to-all: started first, it moves while the dense MLP computes. In backward, autograd
    then runs the dense MLP's backward between sending the tables' gradients and waiting for
    them, and the dense gradients' all-reduce overlaps the tables' update. Same arithmetic.
    """

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        pooled = self.sparse_arch.embedding_bag_collection(sparse_features)
        embedded_dense = self.dense_arch(dense_features)
        values, order = self.sparse_arch.keyed(pooled)
        if isinstance(self.inter_arch, DotInteraction):
            interacted = self.inter_arch(embedded_dense, values, order)
        else:
            interacted = self.inter_arch(dense_features=embedded_dense, sparse_features=in_feature_order(values, order))
        return self.over_arch(interacted)


class SparseFirstDLRM(_SparseFirst, DLRM):
    pass


class SparseFirstDLRM_DCN(_SparseFirst, DLRM_DCN):
    pass


class SparseFirstDLRM_Projection(_SparseFirst, DLRM_Projection):
    pass


_SPARSE_FIRST = {DLRM: SparseFirstDLRM, DLRM_DCN: SparseFirstDLRM_DCN, DLRM_Projection: SparseFirstDLRM_Projection}


class DotInteraction(InteractionArch):
    """DLRM's pairwise dot interaction with a cheaper backward.

    Forward as TorchRec: Z = X X^T over the dense row and the F embeddings, upper triangle.
    Autograd's backward of bmm(X, X^T) takes two bmms plus an index_put and an add; since Z is
    symmetric, dX = (G + G^T) X is one bmm, with G + G^T gathered from the pair gradients in
    one index_select (``sym_source`` maps each of the n*n entries to its pair, or to an
    appended zero column on the diagonal).
    """

    def init_flat_indices(self) -> None:
        # On the CPU kernel's path, the output's rows are padded with zero columns to a multiple
        # of pad_to (set when the next layer is an AlignedLinear, which takes them so).
        self.pad_to = 1
        n = self.F + 1
        rows, cols = self.triu_indices
        pairs = rows.numel()
        sym_source = torch.full((n * n,), pairs, dtype=torch.long)
        sym_source[rows * n + cols] = torch.arange(pairs)
        sym_source[cols * n + rows] = torch.arange(pairs)
        self.register_buffer("flat_upper", rows * n + cols, persistent=False)
        self.register_buffer("sym_source", sym_source, persistent=False)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: torch.Tensor, order: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``order`` (from :meth:`FlatSparseArch.keyed`): feature i is column order[i] of sparse_features."""
        if self.F <= 0:
            return dense_features
        # Float32 even under bf16 autocast: with n = F + 1 = 27 rows the products are small
        # and misaligned for bf16 tensor cores (an H100 ran them in Turing-era kernels), and
        # the casts of the [B, n, D] operand cost more than the products themselves.
        dtype = torch.promote_types(dense_features.dtype, sparse_features.dtype)
        if dtype == torch.float32 and dense_features.device.type == "cpu" and native.library() is not None:
            with torch.autocast("cpu", enabled=False):
                return _NativeDotInteractionFn.apply(dense_features.float(), sparse_features.float(), order, self.pad_to)
        sparse_features = in_feature_order(sparse_features, order)
        with torch.autocast(dense_features.device.type, enabled=False):
            return _DotInteractionFn.apply(
                dense_features.to(dtype), sparse_features.to(dtype), self.flat_upper, self.sym_source
            )


class _DotInteractionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, sparse, flat_upper, sym_source):  # type: ignore[override]
        combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
        b, n, _ = combined.shape
        gram = torch.bmm(combined, combined.transpose(1, 2)).view(b, n * n)
        pairs = gram.index_select(1, flat_upper)
        ctx.save_for_backward(combined, sym_source)
        return torch.cat((dense, pairs), dim=1)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        combined, sym_source = ctx.saved_tensors
        b, n, d = combined.shape
        grad_out = grad_out.to(combined.dtype)
        padded = torch.cat((grad_out[:, d:], grad_out.new_zeros(b, 1)), dim=1)
        sym = padded.index_select(1, sym_source).view(b, n, n)
        # The backward inherits the caller's autocast; keep it float32 as the forward.
        with torch.autocast(combined.device.type, enabled=False):
            if combined.is_cuda:
                # Two products, so the tables' gradient comes out contiguous (the fused table
                # backward needs that; slicing rows 1: of one product cost a full copy there).
                grad_dense = torch.bmm(sym[:, :1], combined).squeeze(1)
                grad_sparse = torch.bmm(sym[:, 1:], combined)
            else:  # one product; on CPU the tables' backward gathers its rows anyway
                grad_combined = torch.bmm(sym, combined)
                grad_dense, grad_sparse = grad_combined[:, 0], grad_combined[:, 1:]
        return grad_dense + grad_out[:, :d], grad_sparse, None, None


class _NativeDotInteractionFn(torch.autograd.Function):
    """The same interaction on CPU through ``cpu_kernels.c``: only the pairs are computed, with
    no concatenated copy of the rows and no full Gram matrix; the pooled embeddings are read in
    the order they arrive in, and their gradient is written contiguous in that order (the
    tables' row-wise Adagrad reads it without a copy). With pad_to > 1, each output row is
    followed by zero columns up to a multiple of pad_to, whose gradient is ignored."""

    @staticmethod
    def forward(ctx, dense, sparse, order, pad_to=1):  # type: ignore[override]
        dense, sparse = dense.contiguous(), sparse.contiguous()
        b, f, d = sparse.shape
        n = f + 1
        ctx.width = width = d + n * (n - 1) // 2
        out = dense.new_empty(b, width + (-width % pad_to))
        out[:, width:].zero_()
        order_ptr = order.data_ptr() if order is not None else None
        native.library().dot_interaction_forward(
            dense.data_ptr(), sparse.data_ptr(), order_ptr, out.data_ptr(), out.shape[1], b, f, d
        )  # fmt: skip
        ctx.save_for_backward(dense, sparse)
        ctx.order = order
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        dense, sparse = ctx.saved_tensors
        b, f, d = sparse.shape
        grad_out = grad_out.float()
        if grad_out.stride(1) != 1 or grad_out.stride(0) < ctx.width:
            grad_out = grad_out.contiguous()
        grad_dense, grad_sparse = torch.empty_like(dense), torch.empty_like(sparse)
        order_ptr = ctx.order.data_ptr() if ctx.order is not None else None
        native.library().dot_interaction_backward(
            grad_out.data_ptr(), grad_out.stride(0), dense.data_ptr(), sparse.data_ptr(), order_ptr,
            grad_dense.data_ptr(), grad_sparse.data_ptr(), b, f, d,
        )  # fmt: skip
        return grad_dense, grad_sparse, None, None
