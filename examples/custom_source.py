"""Your own data in code: a DataSource for ``torchrec-cloud train --data_source``.

The quickstart guide says "replace the SyntheticDataset class with your own data loader"; this
is where that goes, without editing the package. A function ``(config, rank, world_size) ->
DataSource`` builds the source each rank reads; the model's shape comes from the flags::

    torchrec-cloud train --data_source examples/custom_source.py:make_source \
        --num_dense_features 4 --num_sparse_features 3 --num_embeddings 1000 --batch_size 256
    torchrun --standalone --nproc_per_node=2 -m torchrec_cloud train \
        --data_source examples/custom_source.py:make_source --num_dense_features 4 --num_sparse_features 3

The protocol (``torchrec_cloud.data.DataSource``): ``num_train_batches()``, the same on every
rank; ``train_batches(epoch, start_batch)``, this rank's batches of an epoch from
``start_batch`` on (a resumed run asks for the rest of its epoch); ``eval_batches(split,
rows=None)``, ``(batch, valid_rows)`` of ``val`` and ``test`` (with ``rows``, a sample of
that many: ``--eval_rows``, the same rows every time), the same count on every rank (pad
with ``valid_rows`` 0); ``num_eval_rows(split)``, the rows of a whole split. Build a batch's
sparse features with ``torchrec_cloud.data.keyed_jagged_tensor`` (their per-feature counts on
the host). Optional: ``facts()``, what the run's start record says about the data.

Here the rows are made up in memory (``--num_batches_per_epoch`` batches per rank to train
on, a tenth as many rows per held-out split; a label that depends on the features, so the
model has something to learn); load yours instead in ``_load``. Data in Parquet or CSV files needs no
code at all: ``torchrec-cloud data schema`` and ``data preprocess --schema`` (docs/data.md).
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from torchrec_cloud.data import DataSource, keyed_jagged_tensor


class ArraySource(DataSource):
    """Batches of rows held in numpy arrays; rank r takes every world_size-th batch."""

    def __init__(self, cfg, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.batch_size = cfg.data.batch_size
        self.keys = cfg.model.sparse_names  # cat_0, cat_1, ... (or --feature_names)
        self.table_sizes = cfg.model.table_sizes
        train_rows = cfg.data.num_batches_per_epoch * self.batch_size * world_size  # how much to make up
        self.splits = {split: _load(split, train_rows, cfg.model.num_dense_features, self.table_sizes, cfg.data.seed)
                       for split in ("train", "val", "test")}  # fmt: skip

    def num_train_batches(self) -> int:
        rows = len(self.splits["train"][2])
        return rows // (self.batch_size * self.world_size)  # equal on every rank

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        dense, ids, labels = self.splits["train"]
        order = np.random.default_rng([epoch, 0]).permutation(len(labels))  # the same on every rank
        for i in range(start_batch, self.num_train_batches()):
            k = (i * self.world_size + self.rank) * self.batch_size
            rows = order[k : k + self.batch_size]
            yield self._batch(dense[rows], ids[rows], labels[rows])

    def num_eval_rows(self, split: str) -> int:
        return len(self.splits[split][2])

    def eval_batches(self, split: str, rows: Optional[int] = None) -> Iterator[tuple[Batch, int]]:
        dense, ids, labels = self.splits[split]
        n = len(labels) if rows is None else min(rows, len(labels))  # a sample: the first rows
        b, w = self.batch_size, self.world_size
        steps = -(-n // (b * w))  # every rank yields this many
        for s in range(steps):
            lo = (s * w + self.rank) * b
            index = np.arange(lo, max(lo, min(lo + b, n)))
            valid = len(index)
            index = np.concatenate([index, np.zeros(b - valid, np.int64)])  # padding rows, not counted
            yield self._batch(dense[index], ids[index], labels[index]), valid

    def _batch(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> Batch:
        b, f = ids.shape
        # One id per (feature, row); feature-major, as a KeyedJaggedTensor lays them out.
        sparse = keyed_jagged_tensor(self.keys, torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
                                     torch.ones(b * f, dtype=torch.int32), b)  # fmt: skip
        return Batch(dense_features=torch.from_numpy(dense), sparse_features=sparse,
                     labels=torch.from_numpy(labels))  # fmt: skip


def _load(split: str, train_rows: int, num_dense: int, table_sizes: list[int], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``split``: dense float32 [N, D], ids int64 [N, F], labels float32 [N]."""
    g = np.random.default_rng([seed, ("train", "val", "test").index(split)])
    n = train_rows if split == "train" else max(train_rows // 10, 1)
    dense = g.random((n, num_dense), dtype=np.float32)
    ids = np.stack([(g.random(n) ** 2 * size).astype(np.int64) for size in table_sizes], axis=1)
    weights = np.random.default_rng(seed + 1).normal(0, 1, (len(table_sizes), max(table_sizes)))
    logit = dense.sum(axis=1) - num_dense / 2 + weights[np.arange(len(table_sizes)), ids].sum(axis=1)
    labels = (g.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return dense, ids, labels


def make_source(cfg, rank: int, world_size: int) -> DataSource:
    """What ``--data_source examples/custom_source.py:make_source`` calls on every rank."""
    return ArraySource(cfg, rank, world_size)
