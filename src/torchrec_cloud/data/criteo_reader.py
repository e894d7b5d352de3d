"""Reads preprocessed Criteo shards for training: the data source behind ``--dataset_path``.

``torchrec-cloud data preprocess`` (:mod:`torchrec_cloud.data.criteo_preprocess`) writes shards and a
``manifest.json`` to a folder or bucket; this module streams them to each rank as
TorchRec ``Batch`` es::

    torchrec-cloud train --preset criteo-1tb --dataset_path s3://bucket/criteo-1tb
    torchrun --nproc_per_node=8 -m torchrec_cloud train --dataset_path /mnt/criteo --shuffle

How rows reach ranks (``W`` ranks, batch ``B``, ``T`` training rows):

- Training: every rank gets ``n = T // (W * B)`` batches per epoch, the same on every
  rank (unequal counts hang the embedding all-to-all). The epoch's row order is the file
  order, or with ``--shuffle`` 8192-row blocks in a random order starting at a random row
  (wrapping around); rank r takes positions ``[r * n * B, (r + 1) * n * B)`` of that
  order. The last ``T - W * n * B`` rows of the order (fewer than ``W * B``) are left out
  of that epoch: without shuffle always the split's last rows, with it different rows each
  epoch. Every other row is used exactly once per epoch. With ``--shuffle`` rows are also
  shuffled within windows of about 256K rows of a rank.
- Evaluation (``val``, ``test``): the split's rows are divided between ranks as evenly
  as possible (counts differ by at most one); every rank yields the same number of
  batches, the last ones padded, with ``valid_rows`` saying how many rows count. Every row
  of the split is scored exactly once. A sample (``--eval_rows``) is a fixed set of
  8192-row blocks spread evenly over the split, divided between ranks the same way.
- Resume: ``train_batches(epoch, start_batch)`` starts at any batch, with the same rows in
  the same order as an uninterrupted epoch.

Reads are byte ranges of the shards (one per block of rows), done by a few threads ahead
of the training loop, from local disk or through :mod:`torchrec_cloud.storage` from
``s3://``, ``gs://`` and ``az://``.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data import DataSource, keyed_jagged_tensor
from torchrec_cloud.data.criteo_format import (
    CAT_FEATURES,
    INT_FEATURES,
    SPARSE_NAMES,
    check_shards,
    load_manifest,
    record_dtype,
    sparse_dtype_for,
)

SHUFFLE_BLOCK_ROWS = 8192
SAMPLE_BLOCK_ROWS = 8192  # --eval_rows: the sample's contiguous blocks
WINDOW_ROWS = 1 << 18
IO_THREADS = 4


class _Split:
    """Rows of one split as a sequence: position -> (shard, row) via row segments."""

    def __init__(self, segments: list[list[int]]) -> None:
        self.segments = [tuple(s) for s in segments if s[2] > s[1]]
        lengths = [hi - lo for _, lo, hi in self.segments]
        self.starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        self.rows = int(self.starts[-1])

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(shard, first_row, end_row)`` pieces holding split positions ``[lo, hi)``."""
        out = []
        k = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi and k < len(self.segments):
            shard, s_lo, s_hi = self.segments[k]
            offset = lo - int(self.starts[k])
            take = min(hi - lo, (s_hi - s_lo) - offset)
            out.append((shard, s_lo + offset, s_lo + offset + take))
            lo += take
            k += 1
        return out


def _sample(split: _Split, rows: int) -> _Split:
    """About ``rows`` rows of ``split`` (fewer than it has) in blocks of at most
    SAMPLE_BLOCK_ROWS spread evenly over it: block j is the start of the j-th of k equal parts.
    A split read in file order is in time order (a day's log), so a sample of its first rows
    would see one hour; a few contiguous blocks keep the reads few and large."""
    k = math.ceil(rows / SAMPLE_BLOCK_ROWS)
    segments = []
    for j in range(k):
        start, end = split.rows * j // k, split.rows * (j + 1) // k
        take = min(rows * (j + 1) // k - rows * j // k, end - start)
        segments.extend(list(r) for r in split.ranges(start, start + take))
    return _Split(segments)


class CriteoSource(DataSource):
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
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.dense_transform = dense_transform
        self.multi_hot_sizes = list(multi_hot_sizes) if multi_hot_sizes else None
        self.multi_hot_pooling = multi_hot_pooling
        self.io_threads = io_threads
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        if len(self.table_sizes) != CAT_FEATURES:
            raise ConfigError(
                "num_sparse_features",
                f"Criteo data has {CAT_FEATURES} categorical features; the model has {len(self.table_sizes)}",
            )
        stored = manifest.get("num_embeddings_per_feature")
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
        self.splits = {name: _Split(segs) for name, segs in manifest["splits"].items()}
        for name in splits:
            if self.splits[name].rows == 0:
                raise ConfigError("dataset_path", f"{path}: the {name} split has no rows")
        train_rows = self.splits["train"].rows
        self.batches_per_rank = train_rows // (world_size * batch_size)
        if self.batches_per_rank == 0 and "train" in splits:
            raise ConfigError(
                "batch_size",
                f"{path} has {train_rows} training rows, fewer than one batch per rank "
                f"({world_size} x {batch_size}); use a smaller --batch_size",
            )
        self.window_rows = max(batch_size, window_rows // batch_size * batch_size)

    # -- the interface the training loop reads --------------------------------------------

    def num_train_batches(self) -> int:
        return self.batches_per_rank

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        b = self.batch_size
        n = self.batches_per_rank * b  # this rank's rows
        base = self.rank * n  # its first position in the epoch's order
        order = self._train_order(epoch)
        first_window = start_batch * b // self.window_rows
        windows = []
        for w in range(first_window, math.ceil(n / self.window_rows)):
            lo, hi = w * self.window_rows, min((w + 1) * self.window_rows, n)
            windows.append((w, lo, hi, self._order_ranges(order, base + lo, base + hi)))
        index = first_window * self.window_rows // b
        for (w, lo, hi, _), (records, shift) in zip(windows, self._prefetch(windows)):
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch, self.rank, w, 1]).permutation(hi - lo)
                records, shift = records[perm], shift[perm]
            for i in range(0, hi - lo, b):
                if index >= start_batch:
                    yield self._batch(records[i : i + b], shift[i : i + b], (epoch, index))
                index += 1

    def num_eval_rows(self, split: str) -> int:
        return self._held_out(split).rows

    def eval_batches(self, split: str, rows: Optional[int] = None) -> Iterator[tuple[Batch, int]]:
        whole = self._held_out(split)
        part = whole if rows is None or rows >= whole.rows else _sample(whole, rows)
        rows = part.rows
        ws, b = self.world_size, self.batch_size
        base, extra = divmod(rows, ws)
        lo = self.rank * base + min(self.rank, extra)
        mine = base + (1 if self.rank < extra else 0)
        items = math.ceil((base + (1 if extra else 0)) / b)
        windows = []
        for w, start in enumerate(range(0, mine, self.window_rows)):
            end = min(start + self.window_rows, mine)
            windows.append((w, start, end, part.ranges(lo + start, lo + end)))
        produced = 0
        for (_, start, end, _), (records, shift) in zip(windows, self._prefetch(windows)):
            for i in range(0, end - start, b):
                part, sh = records[i : i + b], shift[i : i + b]
                valid = len(part)
                if valid < b:
                    part = np.concatenate((part, np.zeros(b - valid, self.dtype)))
                    sh = np.concatenate((sh, np.full(b - valid, -2, np.int64)))
                yield self._batch(part, sh, None), valid
                produced += 1
        pad = None
        while produced < items:
            if pad is None:
                pad = self._batch(np.zeros(b, self.dtype), np.full(b, -2, np.int64), None)
            yield pad, 0
            produced += 1

    def _held_out(self, split: str) -> _Split:
        if split not in self.splits:  # "train" too: `predict --split all` scores every row
            raise ValueError(f"no split {split!r} in {self.path}")
        return self.splits[split]

    # -- row order and reads -------------------------------------------------------------

    def _train_order(self, epoch: int) -> Optional[tuple[np.ndarray, int]]:
        """The epoch's block order and starting offset (None: file order)."""
        if not self.shuffle:
            return None
        rows = self.splits["train"].rows
        rng = np.random.default_rng([self.seed, epoch, 0])
        blocks = math.ceil(rows / SHUFFLE_BLOCK_ROWS)
        # The order starts at a random row and wraps around, so the rows left out at its
        # end differ from epoch to epoch even when the split is a single block.
        return rng.permutation(blocks), int(rng.integers(rows))

    def _order_ranges(self, order: Optional[tuple[np.ndarray, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Shard ranges for positions ``[lo, hi)`` of the epoch's training order."""
        if order is None:
            return self._split_ranges("train", lo, hi)
        perm, offset = order
        rows = self.splits["train"].rows
        lengths = np.minimum(SHUFFLE_BLOCK_ROWS, rows - perm * SHUFFLE_BLOCK_ROWS)
        starts = np.concatenate(([0], np.cumsum(lengths)))
        out: list[tuple[int, int, int]] = []
        lo, hi = lo + offset, hi + offset
        while lo < hi:
            p = lo % rows
            k = int(np.searchsorted(starts, p, side="right")) - 1
            within = p - int(starts[k])
            take = min(hi - lo, int(lengths[k]) - within)
            first = int(perm[k]) * SHUFFLE_BLOCK_ROWS + within
            out.extend(self._split_ranges("train", first, first + take))
            lo += take
        return out

    def _split_ranges(self, split: str, lo: int, hi: int) -> list[tuple[int, int, int]]:
        return self.splits[split].ranges(lo, hi)

    def _read_range(self, shard: int, lo: int, hi: int) -> np.ndarray:
        size = self.dtype.itemsize
        data = storage.read_bytes(self.shard_urls[shard], start=lo * size, end=hi * size)
        if len(data) != (hi - lo) * size:
            raise storage.StorageError(
                self.shard_urls[shard],
                f"shard is shorter than the manifest says (rows {lo}..{hi} asked, "
                f"{len(data) // size} read); preprocess again",
            )
        return np.frombuffer(data, dtype=self.dtype)

    def _prefetch(self, windows: list) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Records and per-row dense shift of each window, read ahead by worker threads."""
        pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="criteo-read")
        queue: deque[tuple[list[Future], list[tuple[int, int, int]]]] = deque()

        def submit(ranges: list[tuple[int, int, int]]) -> None:
            queue.append(([pool.submit(self._read_range, *r) for r in ranges], ranges))

        try:
            ahead = iter(windows)
            for _ in range(2):
                nxt = next(ahead, None)
                if nxt is not None:
                    submit(nxt[3])
            while queue:
                futures, ranges = queue.popleft()
                parts = [f.result() for f in futures]
                nxt = next(ahead, None)
                if nxt is not None:
                    submit(nxt[3])
                records = np.concatenate(parts) if parts else np.zeros(0, self.dtype)
                shift = np.repeat(self.shard_shift[[r[0] for r in ranges]], [r[2] - r[1] for r in ranges])
                yield records, shift
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

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
