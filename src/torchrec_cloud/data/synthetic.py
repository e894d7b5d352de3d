"""Synthetic data: deterministic in (seed, split, global batch index), each rank reading its
own slice of global batches::

    source = SyntheticSource(cfg, rank, world_size)
    batch = source.make_batch("train", index)

- ``random``: ids uniform over each table, labels fair coin flips (the seeds' data; a model
  cannot beat AUC 0.5 on it).
- ``planted``: ids drawn from a power law, labels drawn from a fixed random *teacher*
  (a logistic model over the same dense and sparse features). Its Bayes-optimal AUC on the
  held-out split is known and reported, so learning is measurable.

Held-out splits (``val``, ``test``) are a fixed set of global batches, independent of the
world size: rank r evaluates global batches r, r+W, ...; ranks that run out evaluate a
padding batch counted with zero rows, so the metric is the same on any number of ranks.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cloud.config import JobConfig
from torchrec_cloud.data import SPLITS, DataSource, feature_names
from torchrec_cloud.data.hashing import hashed_normal, mix


def _split_id(split: str) -> int:
    return SPLITS.index(split)


class Teacher:
    """The fixed random logistic model that labels ``planted`` data.

    logit = bias + dense . v + sum_f s_f * w_f[id_f], with w_f[id] ~ N(0, 1) derived by
    hashing (table, id) and feature scales s_f decaying so some features matter more.
    """

    def __init__(self, num_dense: int, num_sparse: int, seed: int, strength: float = 1.0):
        g = torch.Generator().manual_seed(10_007 + seed)
        self.dense_weight = torch.randn(num_dense, generator=g) * 0.5 * strength
        decay = torch.tensor([0.85**i for i in range(num_sparse)])
        self.sparse_scale = decay / decay.norm() * 1.6 * strength
        self.bias = -1.0  # about a 30% click rate, like Criteo's ~25%
        self.seed = seed
        self.num_sparse = num_sparse

    def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, D] in [0, 1); ``ids`` [B, F] int64 (one id per feature)."""
        tables = torch.arange(self.num_sparse, dtype=torch.int64)
        keys = ids * 1024 + tables  # one key space per (table, id)
        w = hashed_normal(keys, salt=self.seed + 1)
        centred = dense - 0.5
        return self.bias + centred @ self.dense_weight * 2.0 + w @ self.sparse_scale


class SyntheticSource(DataSource):
    """Random or planted data for one rank; see the module docstring."""

    def __init__(self, cfg: JobConfig, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.batch_size = cfg.data.batch_size
        self.kind = cfg.data.synthetic
        self.seed = cfg.data.seed
        self.num_batches = cfg.data.num_batches_per_epoch
        self.num_eval_batches = cfg.data.num_eval_batches
        self.table_sizes = torch.tensor(cfg.model.table_sizes, dtype=torch.int64)
        self.num_dense = cfg.model.num_dense_features
        self.keys = feature_names(cfg.model.num_sparse_features)
        self.teacher = Teacher(self.num_dense, len(self.keys), self.seed)
        self.multi_hot_sizes = cfg.data.multi_hot_sizes
        self.multi_hot_pooling = cfg.data.multi_hot_pooling
        if self.multi_hot_sizes is not None:
            from torchrec_cloud.data.multihot import validate_sizes

            validate_sizes(self.multi_hot_sizes, len(self.keys))

    # The generator behind every batch: a function of (seed, split, global index) only.
    def _features(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
        key = torch.tensor([self.seed * 1_000_003 + _split_id(split) * 7_919 + index * 3])
        g = torch.Generator().manual_seed(int(mix(key)[0]) & 0x7FFF_FFFF_FFFF_FFFF)
        b, f = self.batch_size, len(self.keys)
        dense = torch.rand(b, self.num_dense, generator=g)
        u = torch.rand(b, f, generator=g, dtype=torch.float64)
        if self.kind == "planted":
            # Power law over ids: popular ids carry most of the signal, as in click logs.
            ids = (u**3 * self.table_sizes).long()
        else:
            ids = (u * self.table_sizes).long()
        return dense, torch.minimum(ids, self.table_sizes - 1), g

    def make_batch(self, split: str, index: int) -> Batch:
        dense, ids, g = self._features(split, index)
        if self.kind == "planted":
            p = torch.sigmoid(self.teacher.logits(dense, ids))
            labels = torch.bernoulli(p, generator=g)
        else:
            labels = torch.randint(0, 2, (self.batch_size,), generator=g).float()
        if self.multi_hot_sizes is not None:
            from torchrec_cloud.data.multihot import expand_multi_hot

            sparse = expand_multi_hot(
                ids, self.multi_hot_sizes, self.table_sizes.tolist(), g, self.multi_hot_pooling, self.keys
            )
        else:
            sparse = _one_hot_kjt(self.keys, ids)
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def teacher_probabilities(self, split: str, index: int) -> torch.Tensor:
        dense, ids, _ = self._features(split, index)
        return torch.sigmoid(self.teacher.logits(dense, ids))

    def num_train_batches(self) -> int:
        return self.num_batches

    def train_indices(self, epoch: int, start_batch: int = 0) -> list[int]:
        """The global batch indices this rank trains on in ``epoch`` from ``start_batch``:
        the one list both ``train_batches`` and ``train_loader`` make batches from."""
        first = epoch * self.num_batches
        return [(first + i) * self.world_size + self.rank for i in range(start_batch, self.num_batches)]

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        for index in self.train_indices(epoch, start_batch):
            yield self.make_batch("train", index)

    def train_loader(self, epoch: int, start_batch: int, workers: int, pin: bool) -> Iterator[Batch]:
        """``train_batches`` made by ``workers`` processes (each batch depends only on its
        index, so the batches are the same), ``pin``-ned for the copy to a GPU.

        A subclass that overrides ``train_batches`` (rather than ``train_indices`` or
        ``make_batch``) is not seen here; ``train_batches_ahead`` then reads
        ``train_batches`` instead (``makes_batches_by_index``).
        """
        indices = self.train_indices(epoch, start_batch)
        if not indices:
            return iter(())
        loader = torch.utils.data.DataLoader(
            _TrainBatches(self, indices), batch_size=None, num_workers=workers, pin_memory=pin, prefetch_factor=2
        )
        return iter(loader)

    def makes_batches_by_index(self) -> bool:
        """Whether ``train_batches`` is still ``make_batch`` over ``train_indices``, so
        ``train_loader`` gives the same batches."""
        return type(self).train_batches is SyntheticSource.train_batches

    def train_batches_ahead(self, epoch: int, start_batch: int, workers: int, pin: bool) -> Iterator[Batch]:
        """With ``workers``, the batches are made by that many processes (``train_loader``),
        as long as they are still made by index; otherwise as any other source."""
        if workers and self.makes_batches_by_index():
            yield from self.train_loader(epoch, start_batch, workers, pin)
        else:
            yield from super().train_batches_ahead(epoch, start_batch, workers, pin)

    def eval_batches(self, split: str) -> Iterator[tuple[Batch, int]]:
        steps = math.ceil(self.num_eval_batches / self.world_size)
        for k in range(steps):
            index = k * self.world_size + self.rank
            if index < self.num_eval_batches:
                yield self.make_batch(split, index), self.batch_size
            else:
                yield self.make_batch(split, 0), 0

    def bayes_auc(self, split: str = "val") -> float:
        """AUC of the teacher's own probabilities on the whole held-out split."""
        from torchmetrics.functional.classification import binary_auroc

        probs, labels = [], []
        for index in range(self.num_eval_batches):
            probs.append(self.teacher_probabilities(split, index))
            labels.append(self.make_batch(split, index).labels)
        return float(binary_auroc(torch.cat(probs), torch.cat(labels).long()))

    def facts(self) -> dict[str, Any]:
        """Planted data: the best AUC a model can reach on the validation split."""
        return {"bayes_auc": self.bayes_auc("val")} if self.kind == "planted" else {}


class _TrainBatches(torch.utils.data.Dataset):
    def __init__(self, source: SyntheticSource, indices: list[int]) -> None:
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Batch:
        return self.source.make_batch("train", self.indices[i])


def _one_hot_kjt(keys: list[str], ids: torch.Tensor) -> KeyedJaggedTensor:
    """A KJT with one id per (feature, sample) from ``ids`` [B, F]."""
    b, f = ids.shape
    return KeyedJaggedTensor(
        keys=keys,
        values=ids.t().contiguous().view(-1),
        lengths=torch.ones(b * f, dtype=torch.int32),
        stride=b,
    )
