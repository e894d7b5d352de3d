"""Synthetic data: deterministic in (seed, split, global batch index), each rank reading its
own slice of global batches::

    source = SyntheticSource(cfg, rank, world_size)
    batch = source.make_batch("train", index)

- ``random``: ids uniform over each table, labels fair coin flips (the seeds' data; a model
  cannot beat AUC 0.5 on it).
- ``planted``: ids drawn from a power law, labels drawn from a fixed random *teacher*
  (a logistic model over the dense features and the most frequent ids of each table,
  :class:`Teacher`). Its Bayes-optimal AUC on each held-out split is computed exactly
  and reported with every evaluation, so learning is measurable.

Held-out splits (``val``, ``test``) are a fixed set of global batches, independent of the
world size: rank r evaluates global batches r, r+W, ...; ranks that run out evaluate a
padding batch counted with zero rows, so the metric is the same on any number of ranks. A
sample of N rows (``--eval_rows``) is the split's first N rows: its first global batches.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cloud.config import JobConfig
from torchrec_cloud.data.source import SPLITS, DataSource, keyed_jagged_tensor
from torchrec_cloud.data.hashing import hashed_normal, mix


def _split_id(split: str) -> int:
    return SPLITS.index(split)


# Ids drawn as floor(u ** ID_POWER * rows), u uniform: a power law, so a few ids of each
# table are most of its occurrences, as in click logs. P(id < k) = (k / rows) ** (1 / ID_POWER).
ID_POWER = 3

# The planted signal sits in the HEAD_IDS most frequent ids of each table; the rest carry
# none. A short run sees each of those ids often enough to learn its row, so the
# Bayes-optimal AUC is reachable (docs/quickstart-tuning.md); the other ids' rows, seen a
# few times each, must be learned to stay near zero.
HEAD_IDS = 300


class Teacher:
    """The fixed random logistic model that labels ``planted`` data.

    logit = bias + 2 (dense - 0.5) . v + sum_f s_f * w_f[id_f], with w_f[id] ~ N(0, 1) for
    the ``head`` most frequent ids of table f (derived by hashing (table, id)), 0 for the
    others. The feature scales s_f decay so some features matter more; each is divided by
    sqrt(P(id < head)), so the sparse part's variance is the same for any table size (and a
    table of at most ``head`` rows has the teacher of all ids). Its own probabilities give
    the exact Bayes-optimal AUC of the data (:meth:`SyntheticSource.bayes_auc`).
    """

    def __init__(self, num_dense: int, table_sizes: list[int], seed: int, strength: float = 1.0,
                 head: int = HEAD_IDS):  # fmt: skip
        g = torch.Generator().manual_seed(10_007 + seed)
        num_sparse = len(table_sizes)
        self.dense_weight = torch.randn(num_dense, generator=g) * 0.5 * strength
        decay = torch.tensor([0.85**i for i in range(num_sparse)])
        heads = torch.tensor([min(head, n) for n in table_sizes])
        share = (heads / torch.tensor(table_sizes, dtype=torch.float64)) ** (1 / ID_POWER)
        scale = decay / decay.norm() * 1.6 * strength / share.float().sqrt()
        self.bias = -1.0  # about a 30% click rate, like Criteo's ~25%
        # The head ids' weights, one row per table, zero past each table's head.
        ids = torch.arange(int(heads.max()), dtype=torch.int64)[None, :]
        tables = torch.arange(num_sparse, dtype=torch.int64)[:, None]
        w = hashed_normal(ids * 1024 + tables, salt=seed + 1)  # one key space per (table, id)
        self.head_weights = torch.where(ids < heads[:, None], w * scale[:, None], 0.0)  # [F, head]

    def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, D] in [0, 1); ``ids`` [B, F] int64 (one id per feature)."""
        head = self.head_weights.shape[1]
        offsets = torch.arange(ids.shape[1], dtype=torch.int64) * head
        w = self.head_weights.view(-1)[ids.clamp(max=head - 1) + offsets]
        w = torch.where(ids < head, w, 0.0)
        centred = dense - 0.5
        return self.bias + centred @ self.dense_weight * 2.0 + w.sum(dim=1)


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
        self.keys = cfg.model.sparse_names
        self.teacher = Teacher(self.num_dense, cfg.model.table_sizes, self.seed)
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
            ids = (u**ID_POWER * self.table_sizes).long()
        else:
            ids = (u * self.table_sizes).long()
        return dense, torch.minimum(ids, self.table_sizes - 1), g

    def _planted_labels(self, dense: torch.Tensor, ids: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's click probabilities and the labels drawn from them."""
        p = torch.sigmoid(self.teacher.logits(dense, ids))
        return p, torch.bernoulli(p, generator=g)

    def make_batch(self, split: str, index: int) -> Batch:
        dense, ids, g = self._features(split, index)
        if self.kind == "planted":
            _, labels = self._planted_labels(dense, ids, g)
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
        from torchrec_cloud.preemption import shield_data_worker

        loader = torch.utils.data.DataLoader(
            _TrainBatches(self, indices), batch_size=None, num_workers=workers, pin_memory=pin, prefetch_factor=2,
            worker_init_fn=shield_data_worker,
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

    def train_stream(self, num_epochs: int, workers: int, pin: bool) -> Any:
        """With ``workers``, one DataLoader for the run whose worker processes persist from
        segment to segment (``_RunLoader``), as long as batches are still made by index;
        otherwise as any other source."""
        if workers and self.makes_batches_by_index():
            return _RunLoader(self, num_epochs, workers, pin)
        return super().train_stream(num_epochs, workers, pin)

    def num_eval_rows(self, split: str) -> int:
        return self.num_eval_batches * self.batch_size

    def eval_batches(self, split: str, rows: Optional[int] = None) -> Iterator[tuple[Batch, int]]:
        rows = self.num_eval_rows(split) if rows is None else min(rows, self.num_eval_rows(split))
        batches = math.ceil(rows / self.batch_size)
        for k in range(math.ceil(batches / self.world_size)):
            index = k * self.world_size + self.rank
            if index < batches:
                yield self.make_batch(split, index), min(self.batch_size, rows - index * self.batch_size)
            else:
                yield self.make_batch(split, 0), 0

    def bayes_auc(self, split: str = "val") -> float:
        """AUC of the teacher's own probabilities on the whole held-out split: the best any
        model can reach there."""
        from torchmetrics.functional.classification import binary_auroc

        probs, labels = [], []
        for index in range(self.num_eval_batches):
            p, y = self._planted_labels(*self._features(split, index))  # as make_batch draws them
            probs.append(p)
            labels.append(y)
        return float(binary_auroc(torch.cat(probs), torch.cat(labels).long()))

    def facts(self) -> dict[str, Any]:
        """Planted data: the best AUC a model can reach on each held-out split
        (``bayes_auc``: the validation split's)."""
        if self.kind != "planted":
            return {}
        by_split = {split: self.bayes_auc(split) for split in ("val", "test")}
        return {"bayes_auc": by_split["val"], "bayes_auc_by_split": by_split}


class _TrainBatches(torch.utils.data.Dataset):
    def __init__(self, source: SyntheticSource, indices: list[int]) -> None:
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Batch:
        return self.source.make_batch("train", self.indices[i])


class _RunIndices(torch.utils.data.Sampler):
    """``(epoch, index in the epoch, global batch index)`` from where the run (re)starts to its
    last epoch, read by the DataLoader in the rank's process; its workers make each batch."""

    def __init__(self, source: SyntheticSource, num_epochs: int) -> None:
        self.source, self.num_epochs, self.start = source, num_epochs, (0, 0)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        epoch, first = self.start
        for e in range(epoch, self.num_epochs):
            start = first if e == epoch else 0
            for i, index in enumerate(self.source.train_indices(e, start), start):
                yield e, i, index


class _RunBatches(torch.utils.data.Dataset):
    def __init__(self, source: SyntheticSource) -> None:
        self.source = source

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[int, int, Batch]:
        epoch, i, index = key
        return epoch, i, self.source.make_batch("train", index)


class _RunLoader:
    """The run's training batches from one DataLoader whose ``workers`` processes are forked
    once and persist (``persistent_workers``): opening it again where a segment cut short
    left off resets its iterator (torch's ``_MultiProcessingDataLoaderIter._reset`` through
    ``DataLoader.__iter__``) and keeps the processes. They end with ``close``."""

    def __init__(self, source: SyntheticSource, num_epochs: int, workers: int, pin: bool) -> None:
        from torchrec_cloud.preemption import shield_data_worker

        self.sampler = _RunIndices(source, num_epochs)
        self.loader: Optional[torch.utils.data.DataLoader] = torch.utils.data.DataLoader(
            _RunBatches(source), batch_size=None, sampler=self.sampler, num_workers=workers, pin_memory=pin,
            prefetch_factor=2, persistent_workers=True, worker_init_fn=shield_data_worker,
        )  # fmt: skip

    def open(self, epoch: int, first: int) -> Iterator[tuple[int, int, Batch]]:
        assert self.loader is not None, "opened after close"
        self.sampler.start = (epoch, first)
        for e, i, batch in self.loader:  # pinned, a tuple comes back as a list
            yield e, i, batch

    def close(self) -> None:
        self.loader = None  # its iterator, the last reference to the workers, shuts them down


def _one_hot_kjt(keys: list[str], ids: torch.Tensor) -> KeyedJaggedTensor:
    """A KJT with one id per (feature, sample) from ``ids`` [B, F]."""
    b, f = ids.shape
    return keyed_jagged_tensor(keys, ids.t().contiguous().view(-1), torch.ones(b * f, dtype=torch.int32), b)
