"""The one reader of datasets, read for training: the data source behind ``--dataset_path``
for every dataset of the one manifest format, a schema's or Criteo's (the built-in schema)::

    torchrec-cloud train --dataset_path s3://bucket/events-shards      # features from the manifest
    torchrec-cloud train --preset criteo-1tb --dataset_path s3://bucket/criteo-1tb
    source = build_dataset_source(cfg, rank, world_size)

Rows reach ranks as for every layout (:mod:`~torchrec_cloud.data.shards`); this module reads
a dataset's records and list features (:class:`SchemaSource`) and makes batches of them: a
schema's by :func:`batch_of` (also what ``predict`` calls on raw rows after the same
transforms), Criteo's record (its 13 integers as in the TSV) by
:class:`~torchrec_cloud.data.criteo_reader.CriteoBatcher` (the dense transform, multi-hot).
A schema's features, table sizes and pooling come from the manifest
(``dataset.model_features``), applied to the config before the run starts; Criteo's are the
model's flags (13 dense, 26 sparse, ``--num_embeddings_per_feature``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data.criteo_format import CAT_FEATURES, INT_FEATURES, SPARSE_NAMES, load_criteo
from torchrec_cloud.data.criteo_reader import CriteoBatcher
from torchrec_cloud.data.source import SPLITS, keyed_jagged_tensor
from torchrec_cloud.data.dataset import (
    OFFSET_BYTES,
    Dataset,
    Rows,
    check_vocabularies,
    is_criteo_dataset,
    load_dataset,
    model_features,
    read_manifest,
)
from torchrec_cloud.data.shards import IO_THREADS, WINDOW_ROWS, ShardSource
from torchrec_cloud.untrusted import UntrustedInputError


def batch_of(rows: Rows, keys: Sequence[str], singles: Sequence[int], lists: Sequence[int],
             table_sizes: np.ndarray, where: str) -> Batch:  # fmt: skip
    """A Batch of a schema's rows: dense as stored, one key per sparse feature in schema order
    (``singles``/``lists``: each single-valued/list feature's place in that order). A single
    id of -1 (missing) is an empty bag. An id outside its table (a damaged shard) is an error
    naming ``where``."""
    b = len(rows)
    ids = rows.records["sparse"]
    lengths: list[Any] = [None] * len(keys)
    values: list[Any] = [None] * len(keys)
    for j, k in enumerate(singles):
        col = ids[:, j]
        present = col >= 0
        lengths[k], values[k] = present.astype(np.int32), col[present]
    for j, k in enumerate(lists):
        offsets, vals = rows.lists[j]
        lengths[k], values[k] = np.diff(offsets).astype(np.int32), vals
    for k, v in enumerate(values):
        if len(v) and (int(v.min()) < 0 or int(v.max()) >= table_sizes[k]):
            raise ConfigError("dataset_path", f"{where}: a row has an id outside the table of {keys[k]} "
                              f"({table_sizes[k]} rows): a shard is damaged (find it with: torchrec-cloud data verify)")  # fmt: skip
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(rows.records["dense"])),
        sparse_features=keyed_jagged_tensor(keys, torch.from_numpy(np.concatenate(values).astype(np.int64)),
                                            torch.from_numpy(np.concatenate(lengths).astype(np.int32)), b),  # fmt: skip
        labels=torch.from_numpy(rows.records["label"].astype(np.float32)),
    )


class SchemaSource(ShardSource):
    """Batches of a dataset's shards for one rank: every dataset's, a schema's or Criteo's
    (``criteo``: the batcher of Criteo's record, :func:`criteo_source`)."""

    def __init__(self, dataset: Dataset, *, batch_size: int, rank: int, world_size: int, shuffle: bool = False,
                 seed: int = 0, window_rows: int = WINDOW_ROWS, io_threads: int = IO_THREADS,
                 splits: Sequence[str] = SPLITS, criteo: Optional[CriteoBatcher] = None) -> None:  # fmt: skip
        """``splits``: those that must have rows (see :class:`~torchrec_cloud.data.shards.ShardSource`)."""
        self.dataset = dataset
        self.manifest = dataset.manifest
        self.criteo = criteo
        if criteo is not None:
            # TorchRec's dense transform subtracts the smallest value of each row's input file.
            source_min = [s["dense_min"] for s in dataset.manifest["sources"]]
            self.shard_shift = np.array([source_min[s.source] - 2 for s in dataset.shards], np.int64)
            self.uses_shift = True
        self.dtype = dataset.record
        self.list_dtype = dataset.list_dtype
        self.num_lists = len(dataset.schema.lists)
        sparse = dataset.schema.sparse
        self.keys = [f.name for f in sparse]
        self.singles = [k for k, f in enumerate(sparse) if not f.list]
        self.lists = [k for k, f in enumerate(sparse) if f.list]
        self.table_sizes = criteo.table_sizes if criteo is not None else np.asarray(dataset.table_sizes, np.int64)
        self._init_splits(dataset.path, dataset.splits, batch_size=batch_size, rank=rank, world_size=world_size,
                          shuffle=shuffle, seed=seed, window_rows=window_rows, io_threads=io_threads,
                          required=splits)  # fmt: skip

    def _read(self, shard: Any, start: int, count: int, itemsize: int, what: str) -> bytes:
        if count == 0:  # an empty range (rows whose lists are all empty): no read at all
            return b""
        data = storage.read_bytes(shard.url, start=start, end=start + count * itemsize)
        if len(data) != count * itemsize:
            raise storage.StorageError(shard.url, f"shorter than the manifest says ({what}); copy it again, or preprocess again")
        return data

    def _read_range(self, shard_index: int, lo: int, hi: int) -> Rows:
        ds = self.dataset
        shard = ds.shards[shard_index]
        size = self.dtype.itemsize
        records = np.frombuffer(self._read(shard, lo * size, hi - lo, size, f"rows {lo}..{hi}"), self.dtype)
        lists = []
        for j in range(self.num_lists):
            base = ds.list_offset(shard, j)
            offsets = np.frombuffer(self._read(shard, base + lo * OFFSET_BYTES, hi - lo + 1, OFFSET_BYTES, "offsets"), "<i8")
            first, last = int(offsets[0]), int(offsets[-1])
            if first < 0 or last > shard.values[j] or np.any(np.diff(offsets) < 0):
                raise UntrustedInputError(shard.url, f"list {ds.schema.lists[j].name}",
                                          "offsets out of order or past its ids: the shard is damaged (data verify finds it)")  # fmt: skip
            values_at = base + (shard.rows + 1) * OFFSET_BYTES
            item = self.list_dtype.itemsize
            values = np.frombuffer(self._read(shard, values_at + first * item, last - first, item, "ids"), self.list_dtype)
            lists.append((offsets - first, values))
        if self.criteo is not None:
            return Rows(records, lists, np.full(hi - lo, self.shard_shift[shard_index], np.int64))
        return Rows(records, lists)

    def _make_batch(self, rows: Rows, key: Optional[tuple[int, int]]) -> Batch:
        if self.criteo is not None:
            return self.criteo(rows.records, rows.shift, key)
        return batch_of(rows, self.keys, self.singles, self.lists, self.table_sizes, self.path)

    def facts(self) -> dict[str, Any]:
        """The dataset's facts (:meth:`Dataset.facts`: the digest of its transforms, which
        checkpoints record), once every vocabulary file matches the manifest: read whole, its
        size, checksum and count checked (a ConfigError naming the first that does not).
        Criteo's name the built-in schema and pin its ids modulo the model's table sizes."""
        if self.criteo is not None:
            from torchrec_cloud.data.dataset import PINNED, criteo_digest

            return {"schema": {"name": "criteo"}, PINNED: {"kind": "criteo", "digest": criteo_digest(self.table_sizes)}}
        ds = self.dataset
        problems = check_vocabularies(ds.path, ds.vocab_files, ds.manifest_url)
        if problems:
            more = f" (and {len(problems) - 1} more: torchrec-cloud data verify lists them)" if len(problems) > 1 else ""
            raise ConfigError("dataset_path", f"{problems[0]}{more}")
        return ds.facts()


def criteo_source(path: str, *, batch_size: int, rank: int, world_size: int, table_sizes: Sequence[int],
                  shuffle: bool = False, seed: int = 0, dense_transform: str = "torchrec",
                  multi_hot_sizes: Optional[Sequence[int]] = None, multi_hot_pooling: str = "fixed",
                  window_rows: int = WINDOW_ROWS, io_threads: int = IO_THREADS,
                  splits: Sequence[str] = SPLITS) -> SchemaSource:  # fmt: skip
    """The reader of the Criteo dataset at ``path`` for a model with tables of ``table_sizes``
    rows: its ids, when reduced at preprocessing, must fit them (a ConfigError naming the
    sizes to train with otherwise)."""
    ds = load_criteo(path)
    batcher = CriteoBatcher(table_sizes, ids_reduced=bool(ds.table_sizes), where=path, dense_transform=dense_transform,
                            multi_hot_sizes=multi_hot_sizes, multi_hot_pooling=multi_hot_pooling, seed=seed, rank=rank)  # fmt: skip
    stored = ds.table_sizes
    too_small = [i for i, (s, t) in enumerate(zip(stored, batcher.table_sizes)) if t < s]
    if too_small:
        i = too_small[0]
        raise ConfigError(
            "num_embeddings_per_feature",
            f"the shards in {path} hold ids up to {stored[i] - 1} for {SPARSE_NAMES[i]} "
            f"but its table has {int(batcher.table_sizes[i])} rows; train with the sizes "
            f"the data was preprocessed with ({','.join(map(str, stored))}) or "
            "preprocess again with smaller ones",
        )
    return SchemaSource(ds, batch_size=batch_size, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed,
                        window_rows=window_rows, io_threads=io_threads, splits=splits, criteo=batcher)  # fmt: skip


def build_criteo_source(cfg: JobConfig, rank: int, world_size: int, splits: Sequence[str] = SPLITS) -> SchemaSource:
    """The reader of a Criteo ``--dataset_path`` (``splits``: those that must have rows)."""
    if cfg.model.num_dense_features != INT_FEATURES or cfg.model.num_sparse_features != CAT_FEATURES:
        raise ConfigError(
            "dataset_path",
            f"Criteo data has {INT_FEATURES} dense and {CAT_FEATURES} sparse features; the "
            f"model has {cfg.model.num_dense_features} and {cfg.model.num_sparse_features}",
        )
    if cfg.data.multi_hot_sizes is not None:
        from torchrec_cloud.data.multihot import validate_sizes

        validate_sizes(cfg.data.multi_hot_sizes, CAT_FEATURES)
    return criteo_source(cfg.data.dataset_path or "", batch_size=cfg.data.batch_size, rank=rank, world_size=world_size,
                         table_sizes=cfg.model.table_sizes, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                         dense_transform=cfg.data.dense_transform, multi_hot_sizes=cfg.data.multi_hot_sizes,
                         multi_hot_pooling=cfg.data.multi_hot_pooling, splits=splits)  # fmt: skip


def build_dataset_source(cfg: JobConfig, rank: int, world_size: int) -> ShardSource:
    """The source of ``--dataset_path``: a dataset's shards, a schema's or Criteo's."""
    path = cfg.data.dataset_path or ""
    manifest = read_manifest(path)  # a Criteo dataset of an older version is refused here
    if is_criteo_dataset(manifest):
        return build_criteo_source(cfg, rank, world_size)
    try:
        ds = load_dataset(path, manifest)
    except UntrustedInputError as e:
        raise ConfigError("dataset_path", str(e)) from None
    features = model_features(cfg).model
    if (features.num_dense_features, features.sparse_names, features.table_sizes) != (
        cfg.model.num_dense_features, cfg.model.sparse_names, cfg.model.table_sizes):  # fmt: skip
        raise ConfigError("dataset_path", f"{path} holds {len(ds.schema.dense)} dense and {len(ds.schema.sparse)} sparse "
                          "features; the model was built for others (train reads them from the manifest)")  # fmt: skip
    return SchemaSource(ds, batch_size=cfg.data.batch_size, rank=rank, world_size=world_size,
                        shuffle=cfg.data.shuffle, seed=cfg.data.seed)  # fmt: skip
