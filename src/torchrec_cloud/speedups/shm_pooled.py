"""TorchRec's pooled-embedding all-to-all, in three copies instead of seven, for CPU ranks
that share memory.

Each rank's tables pool a ``[global batch, its dims]`` block; the model needs a
``[its batch, every rank's dims]`` block. TorchRec's ``PooledEmbeddingsAllToAll`` gets there
through generic collectives: a copy of the input into a "registered" buffer, the all-to-all
(through shared memory: this rank's part, the peers' parts into the slot, and out of it), then
``torch.cat`` of the ranks' columns; the backward splits the gradient's columns, makes each
contiguous, concatenates them, and exchanges them the same way. Between the MLPs' matmuls the
embeddings come from DRAM, and torch's strided copy of a block of columns is the slowest of
those copies, several times slower than numpy's row-by-row memcpy of the same bytes
(bench/pooled_a2a_bench.py times the two exchanges alone).

Here each value is copied once on the way out and once on the way in: rank r's rows go into
the slot as they lie, this rank's own rows go straight into their columns of the output, and
the peers' blocks are copied from their slots into their columns. The backward is the mirror
image, and divides the gradient by the world size (``GRADIENT_DIVISION``) in those same copies
rather than in a pass of its own over the whole gradient, as TorchRec does. The values are
TorchRec's, bitwise: the forward only moves them, and both divide each value once, with IEEE
division.
As in TorchRec, the exchange is issued when the tables' output is distributed and completed
when the model first reads it, in the forward, and in the backward when the gradient reaches
the dense part's boundary and when it reaches the tables, so a rank that is a little behind
does not stall the other.

:func:`install` swaps it into a sharded model's table-wise and column-wise output dists whose
process group is a shared-memory one (shm_group.py). Row-wise and data-parallel tables, quantized
communication and other groups keep TorchRec's own.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division, get_use_sync_collectives
from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll, PooledEmbeddingsAwaitable
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from torchrec_cloud.speedups.shm_group import SharedMemoryProcessGroup, as_tensor, backend_of, copy


class _Exchange:
    """One all-to-all of pooled embeddings, forward and backward."""

    __slots__ = ("group", "me", "batch", "dims", "out", "work", "grad_in", "grad_work")

    def __init__(self, group: SharedMemoryProcessGroup, batch: list[int], dims: list[int]):
        self.group, self.me, self.batch, self.dims = group, group.rank(), batch, dims
        self.out: Optional[torch.Tensor] = None
        self.grad_in: Optional[torch.Tensor] = None
        self.work = self.grad_work = None


def _fill(parts: tuple[torch.Tensor, ...], me: int):
    """What finishes an exchange: each peer's bytes into its part (a block of rows or columns)."""

    def finish(chunks: list[np.ndarray]) -> None:
        for r, (part, chunk) in enumerate(zip(parts, chunks)):
            if r != me and part.numel():
                copy(part, as_tensor(chunk, part.dtype, part.shape))

    return finish


class _Send(torch.autograd.Function):
    """Forward: issue the exchange. Backward: complete the gradient's exchange."""

    @staticmethod
    def forward(ctx, x: _Exchange, local_embs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        me = x.me
        out = torch.empty((x.batch[me], sum(x.dims)), dtype=local_embs.dtype, device=local_embs.device)
        rows, cols = local_embs.split(x.batch), out.split(x.dims, dim=1)
        copy(cols[me], rows[me])
        x.work = x.group.exchange([None if r == me else rows[r] for r in range(len(rows))], _fill(cols, me))
        x.out = out
        ctx.x = x
        # Links the two halves in the autograd graph, as TorchRec's Request.dummy_tensor does.
        return torch.empty(1, device=local_embs.device)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):  # type: ignore[override]
        x = ctx.x
        x.grad_work.wait()
        grad, x.grad_in, x.grad_work = x.grad_in, None, None
        return None, grad


class _Receive(torch.autograd.Function):
    """Forward: complete the exchange. Backward: issue the gradient's exchange."""

    @staticmethod
    def forward(ctx, x: _Exchange, _link: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x.work.wait()
        out, x.out, x.work = x.out, None, None
        ctx.x = x
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x = ctx.x
        me = x.me
        grad_in = torch.empty((sum(x.batch), x.dims[me]), dtype=grad_out.dtype, device=grad_out.device)
        rows, cols = grad_in.split(x.batch), grad_out.split(x.dims, dim=1)
        # TorchRec divides the whole gradient by the world size once it has arrived; here each
        # part is divided as it is copied (on its way out, or into this rank's own rows), which
        # is the same division of the same values, without a pass of its own.
        divisor = len(x.batch) if get_gradient_division() else 1
        copy(rows[me], cols[me], divisor)
        x.grad_work = x.group.exchange([None if r == me else cols[r] for r in range(len(cols))], _fill(rows, me),
                                       divisor)  # fmt: skip
        x.grad_in = grad_in
        return None, torch.zeros(1, device=grad_out.device)


class _Pending(Awaitable[torch.Tensor]):
    def __init__(self, x: _Exchange, link: torch.Tensor):
        super().__init__()
        self._x, self._link = x, link

    def _wait_impl(self) -> torch.Tensor:
        return _Receive.apply(self._x, self._link)


class SharedMemoryPooledAllToAll(PooledEmbeddingsAllToAll):
    """``PooledEmbeddingsAllToAll`` with the exchange described in the module's docstring."""

    def __init__(self, group: SharedMemoryProcessGroup, pg: dist.ProcessGroup, dim_sum_per_rank: list[int],
                 device: Optional[torch.device] = None, callbacks: Optional[list[Callable[[torch.Tensor], torch.Tensor]]] = None):  # fmt: skip
        super().__init__(pg, dim_sum_per_rank, device, callbacks)
        self._group = group

    def forward(self, local_embs: torch.Tensor, batch_size_per_rank: Optional[list[int]] = None
                ) -> PooledEmbeddingsAwaitable:  # fmt: skip
        n = self._group.size()
        if local_embs.device.type != "cpu" or get_use_sync_collectives():
            return super().forward(local_embs, batch_size_per_rank)
        if not batch_size_per_rank:
            if local_embs.size(0) % n:
                raise ValueError(f"{n} ranks do not divide the global batch of {local_embs.size(0)}")
            batch_size_per_rank = [local_embs.size(0) // n] * n
        x = _Exchange(self._group, list(batch_size_per_rank), list(self._dim_sum_per_rank))
        awaitable = PooledEmbeddingsAwaitable(tensor_awaitable=_Pending(x, _Send.apply(x, local_embs)))
        awaitable.callbacks.extend(self._callbacks)
        return awaitable


def install(model: torch.nn.Module) -> int:
    """Use :class:`SharedMemoryPooledAllToAll` in every table-wise or column-wise output dist of
    a sharded model whose group moves data through shared memory. Returns how many."""
    swapped = 0
    # A sharded collection keeps its output dists in a plain list, which modules() skips.
    dists = [d for m in model.modules() for d in getattr(m, "_output_dists", None) or ()]
    for module in dists:
        if not isinstance(module, TwPooledEmbeddingDist) or module._codecs is not None:
            continue
        group = backend_of(module._pg)
        if group is not None:
            module._dist = SharedMemoryPooledAllToAll(group, module._pg, module._dim_sum_per_rank, module._device, module._callbacks)
            swapped += 1
    return swapped
