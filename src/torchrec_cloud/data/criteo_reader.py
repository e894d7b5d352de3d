"""Reads the shards of Criteo, the built-in schema, for training: the data source behind
``--dataset_path`` for a folder written by ``data preprocess --format kaggle|terabyte``
(:mod:`~torchrec_cloud.data.reader` sends a manifest whose schema is ``criteo`` here).

``torchrec-cloud data preprocess`` (:mod:`torchrec_cloud.data.criteo_preprocess`) writes shards and a
``manifest.json`` to a folder or bucket; this module streams them to each rank as
TorchRec ``Batch`` es::

    torchrec-cloud train --preset criteo-1tb --dataset_path s3://bucket/criteo-1tb
    torchrun --nproc_per_node=8 -m torchrec_cloud train --dataset_path /mnt/criteo --shuffle

How rows reach ranks, in which order, and how they are read ahead is the shards' reader's
(:mod:`torchrec_cloud.data.shards`, the same for every layout); this module reads Criteo's
fixed-width records and makes their batches: the dense transform (``--dense_transform``),
ids taken modulo the tables, MLPerf's multi-hot bags.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data.source import keyed_jagged_tensor
from torchrec_cloud.data.criteo_format import (
    CAT_FEATURES,
    INT_FEATURES,
    SPARSE_NAMES,
    check_shards,
    load_manifest,
    record_dtype,
    sparse_dtype_for,
    table_sizes as stored_table_sizes,
)
from torchrec_cloud.data.dataset import Rows
from torchrec_cloud.data.shards import IO_THREADS, WINDOW_ROWS, ShardSource


class CriteoSource(ShardSource):
    """Batches of preprocessed Criteo shards for one rank (see the module docstring)."""

    def __init__(
        self,
        path: str,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        table_sizes: Sequence[int],
        shuffle: bool = False,
        seed: int = 0,
        dense_transform: str = "torchrec",
        multi_hot_sizes: Optional[Sequence[int]] = None,
        multi_hot_pooling: str = "fixed",
        window_rows: int = WINDOW_ROWS,
        io_threads: int = IO_THREADS,
        splits: Sequence[str] = ("train", "val", "test"),
    ) -> None:
        """``splits``: the splits that must have rows (``predict`` needs only the one it scores;
        with ``train`` among them, at least one batch per rank)."""
        self.path = path
        self.manifest = manifest = load_manifest(path)
        self.dense_transform = dense_transform
        self.multi_hot_sizes = list(multi_hot_sizes) if multi_hot_sizes else None
        self.multi_hot_pooling = multi_hot_pooling
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        if len(self.table_sizes) != CAT_FEATURES:
            raise ConfigError(
                "num_sparse_features",
                f"Criteo data has {CAT_FEATURES} categorical features; the model has {len(self.table_sizes)}",
            )
        stored = stored_table_sizes(manifest)
        self.ids_reduced = stored is not None
        if stored is not None:
            too_small = [i for i, (s, t) in enumerate(zip(stored, self.table_sizes)) if t < s]
            if too_small:
                i = too_small[0]
                raise ConfigError(
                    "num_embeddings_per_feature",
                    f"the shards in {path} hold ids up to {stored[i] - 1} for {SPARSE_NAMES[i]} "
                    f"but its table has {int(self.table_sizes[i])} rows; train with the sizes "
                    f"the data was preprocessed with ({','.join(map(str, stored))}) or "
                    "preprocess again with smaller ones",
                )
        self.dtype = record_dtype(manifest["record"]["fields"][2]["dtype"])
        if self.dtype.itemsize != manifest["record"]["bytes_per_row"]:
            raise ConfigError("dataset_path", f"{path}: record size in the manifest does not match")
        self.shard_urls = [storage.join(path, *s["path"].split("/")) for s in manifest["shards"]]
        check_shards(path, manifest)  # a missing or truncated shard stops the run here, named
        source_min = [s["dense_min"] for s in manifest["sources"]]
        self.shard_shift = np.array(
            [source_min[s["source"]] - 2 for s in manifest["shards"]], dtype=np.int64
        )
        self._init_splits(path, manifest["splits"], batch_size=batch_size, rank=rank, world_size=world_size,
                          shuffle=shuffle, seed=seed, window_rows=window_rows, io_threads=io_threads,
                          required=splits)  # fmt: skip

    uses_shift = True  # the torchrec dense transform's shift, per source file

    def _read_range(self, shard: int, lo: int, hi: int) -> Rows:
        size = self.dtype.itemsize
        data = storage.read_bytes(self.shard_urls[shard], start=lo * size, end=hi * size)
        if len(data) != (hi - lo) * size:
            raise storage.StorageError(
                self.shard_urls[shard],
                f"shard is shorter than the manifest says (rows {lo}..{hi} asked, "
                f"{len(data) // size} read); preprocess again",
            )
        return Rows(np.frombuffer(data, dtype=self.dtype), [], np.full(hi - lo, self.shard_shift[shard], np.int64))

    def _make_batch(self, rows: Rows, key: Optional[tuple[int, int]]) -> Batch:
        return self._batch(rows.records, rows.shift, key)

    def facts(self) -> dict:
        """The start record names the schema, Criteo's built-in one, and the transforms a
        checkpoint pins: ids modulo the model's table sizes."""
        from torchrec_cloud.data.dataset import PINNED, criteo_digest

        return {"schema": {"name": "criteo"}, PINNED: {"kind": "criteo", "digest": criteo_digest(self.table_sizes)}}

    # -- records to a Batch ----------------------------------------------------------------

    def _check_ids(self, ids: np.ndarray) -> None:
        """Ids reduced at preprocessing fit their tables unless a shard's bytes changed (same
        size, so not caught at open); such an id would index past its table in the kernel."""
        outside = (ids < 0) | (ids >= self.table_sizes)
        if outside.any():
            row, col = np.argwhere(outside)[0]
            raise ConfigError(
                "dataset_path",
                f"{self.path}: a row has id {ids[row, col]} for {SPARSE_NAMES[col]}, outside its table of "
                f"{self.table_sizes[col]} rows: a shard is damaged (find it with: torchrec-cloud data verify "
                f"{self.path})",
            )

    def _batch(self, records: np.ndarray, shift: np.ndarray, key: Optional[tuple[int, int]]) -> Batch:
        b = len(records)
        ids = records["sparse"].astype(np.int64)
        if not self.ids_reduced:
            ids %= self.table_sizes
        else:
            self._check_ids(ids)  # before the dense values: a damaged row's make numpy warn
        raw = records["dense"]
        if self.dense_transform == "log1p":
            dense = np.log(np.maximum(raw, 0) + 1, dtype=np.float32)
        else:
            # torchrec.datasets.criteo: x - (file minimum - 2), then log in float32.
            dense = np.log(raw - shift[:, None], dtype=np.float32)
        ids_t = torch.from_numpy(ids)
        if self.multi_hot_sizes is not None:
            from torchrec_cloud.data.multihot import expand_multi_hot

            g = None
            if self.multi_hot_pooling == "random":
                entropy = [self.seed, self.rank, *(key or (0, 2**31))]
                g = torch.Generator().manual_seed(
                    int(np.random.SeedSequence(entropy).generate_state(1)[0])
                )
            sparse = expand_multi_hot(
                ids_t, self.multi_hot_sizes, self.table_sizes.tolist(), g, self.multi_hot_pooling
            )
        else:
            sparse = keyed_jagged_tensor(
                SPARSE_NAMES, ids_t.t().contiguous().view(-1), torch.ones(b * CAT_FEATURES, dtype=torch.int32), b
            )
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=sparse,
            labels=torch.from_numpy(records["label"].astype(np.float32)),
        )


def build_criteo_source(
    cfg: JobConfig, rank: int, world_size: int, splits: Sequence[str] = ("train", "val", "test")
) -> CriteoSource:
    """The data source for ``--dataset_path`` (called by the training loop on every rank;
    ``splits``: those that must have rows, see :class:`CriteoSource`)."""
    if cfg.model.num_dense_features != INT_FEATURES or cfg.model.num_sparse_features != CAT_FEATURES:
        raise ConfigError(
            "dataset_path",
            f"Criteo data has {INT_FEATURES} dense and {CAT_FEATURES} sparse features; the "
            f"model has {cfg.model.num_dense_features} and {cfg.model.num_sparse_features}",
        )
    if cfg.data.multi_hot_sizes is not None:
        from torchrec_cloud.data.multihot import validate_sizes

        validate_sizes(cfg.data.multi_hot_sizes, CAT_FEATURES)
    return CriteoSource(
        cfg.data.dataset_path or "",
        batch_size=cfg.data.batch_size,
        rank=rank,
        world_size=world_size,
        table_sizes=cfg.model.table_sizes,
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
        dense_transform=cfg.data.dense_transform,
        multi_hot_sizes=cfg.data.multi_hot_sizes,
        multi_hot_pooling=cfg.data.multi_hot_pooling,
        splits=splits,
    )


class CriteoTSV:
    """A raw Criteo TSV file (plain or ``.gz``, local or a URL) read as one held-out split
    (``torchrec-cloud predict`` scores one without preprocessing it first): preprocessing's
    parser, with the model's table sizes, then the shards' own record-to-batch code, so the
    rows are exactly what training read from the shards made of this file. With the
    ``torchrec`` dense transform the file is parsed twice: the log's shift is the file's
    smallest dense value, which preprocessing records per input file. A malformed line
    raises :class:`~torchrec_cloud.data.criteo_parse.PreprocessError` naming FILE:LINE."""

    # The shards' conversion of records to a Batch, shared rather than copied.
    _batch = CriteoSource._batch
    _check_ids = CriteoSource._check_ids

    def __init__(
        self,
        path: str,
        *,
        batch_size: int,
        table_sizes: Sequence[int],
        dense_transform: str = "torchrec",
        multi_hot_sizes: Optional[Sequence[int]] = None,
        multi_hot_pooling: str = "fixed",
        seed: int = 0,
    ) -> None:
        self.path, self.batch_size = path, batch_size
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        self.dense_transform = dense_transform
        self.multi_hot_sizes = list(multi_hot_sizes) if multi_hot_sizes else None
        self.multi_hot_pooling, self.seed, self.rank = multi_hot_pooling, seed, 0
        self.ids_reduced = True  # the parser takes ids modulo the table sizes
        self.dtype = record_dtype(sparse_dtype_for(self.table_sizes.tolist()))

    def _records(self) -> Iterator[np.ndarray]:
        from torchrec_cloud.data.criteo_parse import PreprocessError, parse_block
        from torchrec_cloud.data.criteo_preprocess import line_blocks

        line = 0
        for block in line_blocks(self.path):
            parsed = parse_block(block, self.table_sizes, self.dtype)
            if len(parsed.bad_lines):
                first = int(parsed.bad_lines[0])
                raise PreprocessError(f"{self.path}:{line + first + 1}: {parsed.reasons.get(first, 'malformed line')}")
            line += parsed.lines
            yield parsed.records

    def eval_batches(self, split: str = "all") -> Iterator[tuple[Batch, int]]:
        """Every row of the file, ``batch_size`` at a time (the last batch is short)."""
        shift = 0
        if self.dense_transform != "log1p":
            lows = [int(r["dense"].min()) for r in self._records() if len(r)]
            shift = (min(lows) if lows else 0) - 2

        def batch(rows: np.ndarray) -> tuple[Batch, int]:
            return self._batch(rows, np.full(len(rows), shift, np.int64), None), len(rows)

        bs = self.batch_size
        carry = np.empty(0, self.dtype)  # rows of the last block short of a batch
        for records in self._records():
            rows = np.concatenate((carry, records)) if len(carry) else records
            whole = len(rows) // bs * bs
            for lo in range(0, whole, bs):
                yield batch(rows[lo : lo + bs])
            carry = rows[whole:]
        if len(carry):
            yield batch(carry)
