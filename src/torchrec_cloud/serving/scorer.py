"""The self-contained scoring module that ``export`` writes as TorchScript (``scorer.pt``).

It holds the trained model's own dense arch, interaction and over arch (TorchRec's modules,
compiled by TorchScript, so loading needs neither TorchRec nor this package) and, instead
of TorchRec's EmbeddingBagCollection (whose fused kernels are fbgemm operators), every
table in one plain tensor, looked up with plain torch ops::

    scorer = torch.jit.load("model/scorer.pt")          # torch alone
    probabilities = scorer(dense, ids)                   # [B, 13] float, [B, 26] int64 -> [B]
    logits = scorer.logits_of_bags(dense, values, lengths)   # multi-hot bags, KJT layout

``export --format pt2`` writes the same module as a torch.export program compiled by
AOTInductor (``scorer.pt2``, :class:`BagLogits`: ``logits_of_bags`` is its forward); load
either through :func:`torchrec_cloud.serving.runtime.load_scorer`.

Tables are stored in one of three forms (``--quantize``): ``none`` (float32, the trained
values), ``fp16`` (half the bytes) or ``int8`` (a quarter, plus a float16 scale and offset
per row: TorchRec's (fbgemm's) row-wise scheme, ``row = q * scale + bias``). Lookups return float32.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZE = ("none", "fp16", "int8")
TABLE_BUFFERS = ("weight", "scale", "bias")
"""The buffers of :class:`Tables` that hold the tables' values (``export`` writes them to
``tables.pt`` too, which ``serve`` maps in their place); the others are small."""


class Tables(nn.Module):
    """Every embedding table in one ``[sum(rows), dim]`` tensor, table ``f`` starting at
    ``row_offsets[f]``; each bag is the sum of its rows (TorchRec's ``sum`` pooling), or their
    mean for the tables ``mean`` marks (``mean`` pooling; an empty bag is zeros either way)."""

    def __init__(self, tables: Sequence[torch.Tensor], quantize: str = "none", mean: Sequence[bool] = ()) -> None:
        super().__init__()
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        whole = torch.cat([t.detach().float() for t in tables])
        sizes = torch.tensor([t.shape[0] for t in tables], dtype=torch.int64)
        self.quantize = quantize
        self.bag_op = False  # export sets it for the pt2 program: see forward
        self.num_features = len(tables)
        self.dim = int(whole.shape[1])
        self.register_buffer("row_offsets", torch.cumsum(sizes, 0) - sizes)
        self.register_buffer("table_sizes", sizes)
        means = torch.tensor([bool(m) for m in mean] if mean else [False] * len(tables), dtype=torch.bool)
        self.register_buffer("mean_pooled", means)
        self.any_mean = bool(means.any())
        empty = torch.zeros(0)
        if quantize == "int8":
            # As fbgemm's row-wise int8 tables: scale and bias in float16, next to each row.
            low = whole.min(dim=1).values.half()
            scale = ((whole.max(dim=1).values - low.float()) / 255.0).half()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round((whole - low.float()[:, None]) / scale.float()[:, None]).clamp(0, 255)
            self.register_buffer("weight", q.to(torch.uint8))
            self.register_buffer("scale", scale)
            self.register_buffer("bias", low)
        else:
            self.register_buffer("weight", whole.half() if quantize == "fp16" else whole)
            self.register_buffer("scale", empty)
            self.register_buffer("bias", empty)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the stacked tables, as float32."""
        if self.quantize == "int8":
            return self.weight[index].float() * self.scale[index].float().unsqueeze(1) + self.bias[index].float().unsqueeze(1)
        return self.weight[index].float()

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Pooled embeddings ``[B, F, D]`` of bags in TorchRec's KeyedJaggedTensor layout:
        ``lengths`` [F * B], feature-major; ``values`` the ids of every bag in that order."""
        bags = self.num_features * batch_size
        # output_size: without it torch.export sees the total as data-dependent and bakes the
        # example batch's bounds into a runtime assertion (a batch of 1, or of empty bags, failed).
        bag = torch.repeat_interleave(torch.arange(bags, device=values.device), lengths.long(), output_size=values.shape[0])
        index = values.long() + self.row_offsets[torch.div(bag, batch_size, rounding_mode="floor")]
        if self.bag_op and self.quantize == "none":
            # The pt2 program: AOTInductor compiles index_add_ to an atomic add per id and
            # dimension; embedding_bag stays aten's own kernel, which sums each bag in place.
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=values.device), torch.cumsum(lengths.long(), 0)])
            pooled = F.embedding_bag(index, self.weight, offsets, mode="sum", include_last_offset=True)
        else:
            pooled = torch.zeros(bags, self.dim, device=values.device)
            pooled.index_add_(0, bag, self.rows(index))
        if self.any_mean:
            per_bag = self.mean_pooled.repeat_interleave(batch_size)
            divisor = torch.where(per_bag, lengths.clamp(min=1).to(pooled.dtype), torch.ones_like(per_bag, dtype=pooled.dtype))
            pooled = pooled / divisor.unsqueeze(1)
        return pooled.view(self.num_features, batch_size, self.dim).transpose(0, 1)


class Scorer(nn.Module):
    """Dense features and sparse ids to click probabilities: DLRM's forward, tables included."""

    def __init__(self, dense_arch: nn.Module, inter_arch: nn.Module, over_arch: nn.Module, tables: Tables) -> None:
        super().__init__()
        self.dense_arch = dense_arch
        self.inter_arch = inter_arch
        self.over_arch = over_arch
        self.tables = tables

    @torch.jit.export
    def logits_of_bags(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]`` for multi-hot bags (see :meth:`Tables.forward`)."""
        batch_size = dense.shape[0]
        embedded_dense = self.dense_arch(dense)
        embedded_sparse = self.tables(values, lengths, batch_size)
        return self.over_arch(self.inter_arch(embedded_dense, embedded_sparse)).view(-1)

    @torch.jit.export
    def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]``: ``dense`` [B, num_dense] float, ``ids`` [B, num_sparse] int64."""
        values = ids.t().reshape(-1)
        lengths = torch.ones(values.shape[0], dtype=torch.int64, device=ids.device)
        return self.logits_of_bags(dense, values, lengths)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Click probabilities ``[B]``, one id per sparse feature (what a server calls)."""
        return torch.sigmoid(self.logits(dense, ids))


class BagLogits(nn.Module):
    """A :class:`Scorer`'s ``logits_of_bags`` as ``forward``: the one entry point of the
    torch.export program (``scorer.pt2``), since an exported program has a single graph.
    Inputs as :meth:`Tables.forward`: ``dense`` [B, num_dense] float32, ``values`` [N] and
    ``lengths`` [F * B] int64."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        self.scorer = scorer

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.scorer.logits_of_bags(dense, values, lengths)
