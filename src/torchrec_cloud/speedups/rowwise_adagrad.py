"""Row-wise Adagrad in backward for TorchRec's fused tables on CPU, without fbgemm's CPU kernel.

fbgemm's CPU backward (``split_embedding_backward_codegen_rowwise_adagrad_cpu``) loops over
the tables one by one, sorting each table's ids and opening parallel regions per table, a
fixed cost per table that made it the largest non-matmul item of a CPU training step. This
module does the same update for all tables at once:

1. every id becomes a global row of the flat weight buffer (table offset + id), and finds
   its pooled gradient in the ``(B, total_D)`` output gradient (whatever its row stride);
2. each row's gradient is the sum over its ids (times per-sample weights, or 1/bag length
   for mean pooling), in id order;
3. ``h += mean(g^2)``; ``w -= lr * g / (sqrt(h) + eps)``, as fbgemm's exact row-wise Adagrad.

Steps 2-3 run in ``cpu_kernels.c`` (native.py): the rows are split between the OpenMP
threads by row, and each thread merges its repeats in a hash table, with no sort. Where that
library cannot be built, whole-batch torch ops do the same (one sort groups the repeats).

It writes into the same ``weights_host`` / ``momentum1_host`` tensors that TorchRec's
sharded modules, optimizer state and checkpoints expose, so nothing outside the update
changes.

:func:`install` routes the CPU row-wise Adagrad lookups of a sharded model's TBEs here
(the speed-ups layer does, unless ``--cpu_embedding_update fbgemm``). It handles the
common case (float32 weights, sum or mean pooling, optional per-sample weights, one
embedding dim per TBE, no gradient clipping, max-norm or weight decay); anything else goes
to fbgemm unchanged.

On the same path the forward lookup runs in ``cpu_kernels.c`` too (:func:`pooled_lookup`):
all the tables in one parallel region, the samples split between the threads, each thread
table by table with the rows ahead prefetched (fbgemm's CPU forward opens a region per
table; bench/cpu_kernels_bench.py times the two). It sums each bag's ids in order, as fbgemm
does, so its output is fbgemm's bit for bit.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from torchrec_cloud import compat
from torchrec_cloud.speedups import native

_ORIGINAL: Optional[Callable[..., torch.Tensor]] = None  # fbgemm's invoker, once wrapped
# The TBEs whose lookups go through _invoke, by their placeholder parameter (one per TBE,
# what fbgemm hands the invoker): a TBE that is gone drops out by itself.
_installed: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


class _RowwiseAdagradLookup(torch.autograd.Function):
    """Pooled lookup whose backward applies exact row-wise Adagrad to the touched rows."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        placeholder: torch.Tensor,
        weights: torch.Tensor,
        momentum: torch.Tensor,
        row_base: torch.Tensor,
        common: Any,
        optimizer_args: Any,
        momentum1: Any,
        kwargs: dict,
        lr: float,
    ) -> torch.Tensor:
        out = pooled_lookup(
            weights, row_base, common.indices, common.offsets, common.indice_weights,
            mean_pooling=common.pooling_mode == compat.POOLING_MEAN,
        )  # fmt: skip
        if out is None:  # fbgemm's own lookup; autograd is off inside Function.forward, so it only looks up
            assert _ORIGINAL is not None
            out = _ORIGINAL(common, optimizer_args, momentum1, **kwargs)
        ctx.save_for_backward(common.indices, common.offsets)
        ctx.indice_weights = common.indice_weights
        ctx.weights, ctx.momentum, ctx.row_base = weights, momentum, row_base
        ctx.pooling_mode, ctx.lr, ctx.eps = common.pooling_mode, lr, optimizer_args.eps
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:  # type: ignore[override]
        indices, offsets = ctx.saved_tensors
        with torch.no_grad():
            rowwise_adagrad_update(
                ctx.weights,
                ctx.momentum,
                ctx.row_base,
                indices,
                offsets,
                grad_output,
                lr=ctx.lr,
                eps=ctx.eps,
                indice_weights=ctx.indice_weights,
                mean_pooling=ctx.pooling_mode == compat.POOLING_MEAN,
            )
        return (None,) * 9


def pooled_lookup(
    weights: torch.Tensor,
    row_base: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    indice_weights: Optional[torch.Tensor] = None,
    *,
    mean_pooling: bool = False,
) -> Optional[torch.Tensor]:
    """The pooled embeddings ``(B, T*D)`` of T features' bags, as fbgemm's CPU forward computes
    them, from ``cpu_kernels.c``; None where that library is not available.

    Same layout as :func:`rowwise_adagrad_update`: ``weights`` is ``(rows, D)``, feature t's
    table starts at row ``row_base[t]``, bags are feature-major.
    """
    lib = native.library()
    if lib is None or weights.dtype != torch.float32 or not weights.is_contiguous():
        return None
    if indice_weights is not None and indice_weights.dtype != torch.float32:
        return None
    num_features, dim = row_base.numel(), weights.shape[1]
    batch = (offsets.numel() - 1) // max(num_features, 1)
    out = weights.new_empty(batch, num_features * dim)
    if out.numel() == 0:
        return out.zero_()
    indices, offsets, row_base = indices.long().contiguous(), offsets.long().contiguous(), row_base.long().contiguous()
    if indice_weights is not None:
        indice_weights = indice_weights.contiguous()
    status = lib.pooled_lookup(
        weights.data_ptr(), weights.shape[0], dim, row_base.data_ptr(), num_features, batch, indices.data_ptr(),
        offsets.data_ptr(), indice_weights.data_ptr() if indice_weights is not None else None, int(mean_pooling),
        out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"pooled lookup: an embedding row is outside the {weights.shape[0]} rows of its tables")
    return out


def rowwise_adagrad_update(
    weights: torch.Tensor,
    momentum: torch.Tensor,
    row_base: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    grad_output: torch.Tensor,
    *,
    lr: float,
    eps: float,
    indice_weights: Optional[torch.Tensor] = None,
    mean_pooling: bool = False,
) -> None:
    """Apply exact row-wise Adagrad in place for one batch of bags.

    ``weights`` is the flat buffer of T features' tables viewed as ``(rows, D)``;
    ``momentum`` has one entry per row; ``row_base[t]`` is feature t's first row; bags are
    laid out feature-major (``offsets`` has T*B+1 entries), as in a KeyedJaggedTensor;
    ``grad_output`` is ``(B, T*D)``.
    """
    num_features = row_base.numel()
    num_bags = offsets.numel() - 1
    batch = num_bags // num_features
    dim = weights.shape[1]
    n = indices.numel()
    if n == 0 or batch == 0:
        return
    offsets = offsets.long()
    lib = native.library()
    in_c = lib is not None and grad_output.dtype == torch.float32 and weights.is_contiguous() and momentum.is_contiguous()
    if in_c and grad_output.stride(1) != 1:
        grad_output = grad_output.contiguous()
    if in_c and indice_weights is None and not mean_pooling:  # every id's gradient as it is: one C pass prepares them
        indices, offsets, row_base = indices.long().contiguous(), offsets.contiguous(), row_base.long().contiguous()
        rows, src = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
        if lib.bag_rows(indices.data_ptr(), offsets.data_ptr(), n, row_base.data_ptr(), num_features, batch, dim,
                        grad_output.stride(0), rows.data_ptr(), src.data_ptr()):  # fmt: skip
            raise _bad_offsets(num_bags, n)
        _update_in_c(lib, weights, momentum, rows, src, None, grad_output, lr, eps)
        return
    lengths = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != n or bool((lengths < 0).any()):
        raise _bad_offsets(num_bags, n)
    one_per_bag = n == num_bags and bool((lengths == 1).all())
    bag_ids = torch.arange(num_bags, device=indices.device)
    bag = bag_ids if one_per_bag else torch.repeat_interleave(bag_ids, lengths, output_size=n)
    feature = torch.div(bag, batch, rounding_mode="floor")
    rows = indices.long() + row_base.index_select(0, feature)
    scale = None
    if indice_weights is not None or mean_pooling:
        scale = torch.ones(n, dtype=grad_output.dtype, device=grad_output.device)
        if indice_weights is not None:
            scale = scale * indice_weights.to(grad_output.dtype)
        if mean_pooling:
            scale = scale / lengths.clamp_min(1).to(grad_output.dtype).index_select(0, bag)

    if in_c:
        # where each id's pooled gradient starts in grad_output's memory (any row stride)
        src = (bag - feature * batch) * grad_output.stride(0) + feature * dim
        _update_in_c(lib, weights, momentum, rows, src, scale, grad_output, lr, eps)
        return
    # row of grad_output viewed as (B * T, D) that holds each id's pooled gradient
    grad_rows = (bag - feature * batch) * num_features + feature
    _update_with_torch_ops(weights, momentum, rows, grad_rows, scale, grad_output, lr, eps)


def _bad_offsets(num_bags: int, n: int) -> ValueError:
    return ValueError(f"row-wise Adagrad: the {num_bags + 1} bag offsets must run from 0 to the {n} ids without decreasing")


def _update_in_c(lib, weights, momentum, rows, src, scale, grad_output, lr: float, eps: float) -> None:
    status = lib.rowwise_adagrad_update(
        weights.data_ptr(), momentum.data_ptr(), weights.shape[0], weights.shape[1], rows.data_ptr(), src.data_ptr(),
        scale.data_ptr() if scale is not None else None, grad_output.data_ptr(), rows.numel(), lr, eps,
    )  # fmt: skip
    if status == -2:
        raise IndexError(f"row-wise Adagrad: an embedding row is outside the {weights.shape[0]} rows of its tables")
    if status != 0:
        raise MemoryError("row-wise Adagrad: the CPU kernel could not allocate its buffers")


def _update_with_torch_ops(weights, momentum, rows, grad_rows, scale, grad_output, lr: float, eps: float) -> None:
    """The same update from whole-batch torch ops (one sort groups the repeated rows)."""
    dim = weights.shape[1]
    n = rows.numel()
    sorted_rows, order = torch.sort(rows)
    uniq, inverse, counts = torch.unique_consecutive(sorted_rows, return_inverse=True, return_counts=True)
    source = grad_rows.index_select(0, order)
    if scale is not None:
        scale = scale.index_select(0, order)
    grads = grad_output.reshape(-1, dim)
    first = counts.cumsum(0) - counts
    grad = grads.index_select(0, source.index_select(0, first))
    if scale is not None:
        grad.mul_(scale.index_select(0, first).unsqueeze(1))
    if uniq.numel() != n:  # rows that occur more than once: add the other occurrences
        repeat = torch.ones(n, dtype=torch.bool, device=rows.device)
        repeat[first] = False
        rest = repeat.nonzero().squeeze(1)
        extra = grads.index_select(0, source.index_select(0, rest))
        if scale is not None:
            extra.mul_(scale.index_select(0, rest).unsqueeze(1))
        grad.index_add_(0, inverse.index_select(0, rest), extra)

    state = momentum.index_select(0, uniq).add_(torch.linalg.vector_norm(grad, dim=1).square_().div_(dim))
    momentum.index_copy_(0, uniq, state)
    grad.mul_(state.sqrt_().add_(eps).reciprocal_().mul_(-lr).unsqueeze(1))
    weights.index_add_(0, uniq, grad)


def _fast_path(common: Any, optimizer_args: Any, momentum1: Any, extra: dict) -> Optional[tuple]:
    """The tensors the fast update needs, or None when this call must go to fbgemm."""
    host = common.host_weights
    if host.numel() == 0 or host.dtype != torch.float32 or host.device.type != "cpu":
        return None
    if common.pooling_mode not in (compat.POOLING_SUM, compat.POOLING_MEAN) or common.output_dtype != compat.SPARSE_DTYPE_FP32:
        return None
    if common.vbe_metadata is not None and common.vbe_metadata.B_offsets is not None:
        return None
    if common.feature_requires_grad is not None or set(extra) - {"mixed_D"}:
        return None
    if optimizer_args.gradient_clipping or optimizer_args.max_norm or optimizer_args.weight_decay:
        return None
    d_offsets = common.D_offsets.long()
    dims = d_offsets[1:] - d_offsets[:-1]
    if dims.numel() == 0 or not bool((dims == dims[0]).all()):
        return None
    dim = int(dims[0])
    weights_offsets = common.weights_offsets.long()
    if bool((weights_offsets % dim != 0).any()) or host.numel() % dim != 0:
        return None
    row_base = weights_offsets // dim
    if momentum1 is None or not torch.equal(momentum1.offsets.long(), row_base):
        return None
    momentum = momentum1.host
    if momentum.dtype != torch.float32 or momentum.numel() * dim != host.numel():
        return None
    return host.detach().view(-1, dim), momentum.detach(), row_base


def _invoke(common: Any, optimizer_args: Any, momentum1: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    assert _ORIGINAL is not None
    ours = _installed.get(id(common.placeholder_autograd_tensor)) is common.placeholder_autograd_tensor
    fast = _fast_path(common, optimizer_args, momentum1, kwargs) if ours and not args else None
    if fast is None or not torch.is_grad_enabled():
        return _ORIGINAL(common, optimizer_args, momentum1, *args, **kwargs)
    weights, momentum, row_base = fast
    lr = float(common.learning_rate_tensor)
    return _RowwiseAdagradLookup.apply(
        common.placeholder_autograd_tensor, weights, momentum, row_base, common, optimizer_args, momentum1, kwargs, lr
    )


def install(module: torch.nn.Module) -> int:
    """Route the CPU row-wise Adagrad lookups of every fbgemm TBE in ``module`` (a sharded
    model, or one TBE) through :func:`pooled_lookup` and :func:`rowwise_adagrad_update`.
    Returns how many TBEs. fbgemm's invoker is wrapped once per process; other TBEs, and
    calls that :func:`_fast_path` declines, still go to fbgemm."""
    global _ORIGINAL
    from fbgemm_gpu.split_embedding_codegen_lookup_invokers import lookup_rowwise_adagrad

    if _ORIGINAL is None:
        _ORIGINAL = lookup_rowwise_adagrad.invoke
        lookup_rowwise_adagrad.invoke = _invoke
    tbes = compat.table_batched_modules(module)
    for tbe in tbes:
        _installed[id(tbe.placeholder_autograd_tensor)] = tbe.placeholder_autograd_tensor
    return len(tbes)


def uninstall(module: torch.nn.Module) -> None:
    """Give the TBEs in ``module`` fbgemm's own CPU kernel back."""
    for m in module.modules():
        placeholder = getattr(m, "placeholder_autograd_tensor", None)
        if placeholder is not None and _installed.get(id(placeholder)) is placeholder:
            del _installed[id(placeholder)]
