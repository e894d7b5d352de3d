"""Criteo's record to a batch: the dense transform (``--dense_transform``), ids taken modulo
the tables, MLPerf's multi-hot bags (:class:`CriteoBatcher`); and a raw Criteo TSV read as one
held-out split (:class:`CriteoTSV`, what ``predict`` scores without preprocessing).

Criteo's shards are read by the one reader of every dataset,
:class:`~torchrec_cloud.data.reader.SchemaSource` (``reader.criteo_source`` for a folder written
by ``data preprocess --format kaggle|terabyte``), which hands each window of records to a
:class:`CriteoBatcher`; :class:`CriteoTSV` hands the records it parses to the same batcher, so a
raw line scores exactly as the shards made of it train::

    torchrec-cloud train --preset criteo-1tb --dataset_path s3://bucket/criteo-1tb
    torchrec-cloud predict --model_dir M --input day_23.gz
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch

from torchrec_cloud.config import ConfigError
from torchrec_cloud.data.criteo_format import CAT_FEATURES, SPARSE_NAMES, record_dtype, sparse_dtype_for
from torchrec_cloud.data.source import keyed_jagged_tensor


class CriteoBatcher:
    """Criteo's records (label, the 13 integers as in the TSV, 26 ids) to a TorchRec ``Batch``:
    the one conversion, for its shards and for raw lines. ``ids_reduced``: the ids were taken
    modulo the tables when preprocessed (then checked to fit, else reduced here); ``where``
    names the data in errors; ``seed`` and ``rank`` seed random multi-hot pooling."""

    def __init__(self, table_sizes: Sequence[int], *, ids_reduced: bool, where: str, dense_transform: str = "torchrec",
                 multi_hot_sizes: Optional[Sequence[int]] = None, multi_hot_pooling: str = "fixed", seed: int = 0,
                 rank: int = 0) -> None:  # fmt: skip
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        if len(self.table_sizes) != CAT_FEATURES:
            raise ConfigError(
                "num_sparse_features",
                f"Criteo data has {CAT_FEATURES} categorical features; the model has {len(self.table_sizes)}",
            )
        self.ids_reduced, self.where = ids_reduced, where
        self.dense_transform = dense_transform
        self.multi_hot_sizes = list(multi_hot_sizes) if multi_hot_sizes else None
        self.multi_hot_pooling, self.seed, self.rank = multi_hot_pooling, seed, rank

    def _check_ids(self, ids: np.ndarray) -> None:
        """Ids reduced at preprocessing fit their tables unless a shard's bytes changed (same
        size, so not caught at open); such an id would index past its table in the kernel."""
        outside = (ids < 0) | (ids >= self.table_sizes)
        if outside.any():
            row, col = np.argwhere(outside)[0]
            raise ConfigError(
                "dataset_path",
                f"{self.where}: a row has id {ids[row, col]} for {SPARSE_NAMES[col]}, outside its table of "
                f"{self.table_sizes[col]} rows: a shard is damaged (find it with: torchrec-cloud data verify "
                f"{self.where})",
            )

    def _features(self, records: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' ids (int64, within their tables) and transformed dense values."""
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
        return ids, dense

    def bags(self, records: np.ndarray, shift: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a scorer takes of the batch :meth:`__call__` makes: its dense features and its
        KeyedJaggedTensor's values and lengths (one id a bag, keys first), without the batch."""
        if self.multi_hot_sizes is not None:
            batch = self(records, shift, None)
            return batch.dense_features, batch.sparse_features.values(), batch.sparse_features.lengths()
        ids, dense = self._features(records, shift)
        return torch.from_numpy(dense), torch.from_numpy(ids.T.reshape(-1)), torch.ones(ids.size, dtype=torch.int64)

    def __call__(self, records: np.ndarray, shift: np.ndarray, key: Optional[tuple[int, int]]) -> Batch:
        """``shift``: per row, the smallest dense value of its input file minus 2 (TorchRec's
        transform); ``key``: the batch's place, which seeds random multi-hot pooling."""
        b = len(records)
        ids, dense = self._features(records, shift)
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
        # Here, not at import: serving a Criteo model reads its rows with this module, and
        # importing TorchRec (its planner, torch._dynamo) would delay every replica's start.
        from torchrec.datasets.utils import Batch

        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=sparse,
            labels=torch.from_numpy(records["label"].astype(np.float32)),
        )


class CriteoTSV:
    """A raw Criteo TSV file (plain or ``.gz``, local or a URL) read as one held-out split
    (``torchrec-cloud predict`` scores one without preprocessing it first): preprocessing's
    parser, with the model's table sizes, then the shards' own record-to-batch code, so the
    rows are exactly what training read from the shards made of this file. With the
    ``torchrec`` dense transform the file is parsed twice: the log's shift is the file's
    smallest dense value, which preprocessing records per input file. A malformed line
    raises :class:`~torchrec_cloud.data.criteo_parse.PreprocessError` naming FILE:LINE."""

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
        # The shards' conversion of records to a Batch, shared rather than copied; the parser
        # takes ids modulo the table sizes.
        self.batcher = CriteoBatcher(table_sizes, ids_reduced=True, where=path, dense_transform=dense_transform,
                                     multi_hot_sizes=multi_hot_sizes, multi_hot_pooling=multi_hot_pooling, seed=seed)  # fmt: skip
        self.table_sizes = self.batcher.table_sizes
        self.dense_transform = dense_transform
        self.dtype = record_dtype(sparse_dtype_for(self.table_sizes.tolist()))

    def _records(self) -> Iterator[np.ndarray]:
        from torchrec_cloud.data.criteo_parse import PreprocessError, parse_block
        from torchrec_cloud.data.criteo_tsv import line_blocks

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
            return self.batcher(rows, np.full(len(rows), shift, np.int64), None), len(rows)

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
