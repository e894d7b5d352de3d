"""One reader of preprocessed shards, whatever their layout: how rows reach ranks, in which
order, read ahead from a folder or a bucket. A subclass (every dataset's, a schema's or
Criteo's: :class:`~torchrec_cloud.data.reader.SchemaSource`) says how a range of rows is read
and how rows become a ``Batch``; everything else is here::

    class MySource(ShardSource):
        def _read_range(self, shard, lo, hi) -> Rows: ...
        def _make_batch(self, rows, key) -> Batch: ...

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

Reads are byte ranges of the shards (one per block of rows and section), done by a few
threads ahead of the training loop, from local disk or through :mod:`torchrec_cloud.storage`
from ``s3://``, ``gs://`` and ``az://``.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np

from torchrec_cloud.config import ConfigError
from torchrec_cloud.data.source import SPLITS, DataSource
from torchrec_cloud.data.dataset import Rows

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch

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


class ShardSource(DataSource):
    """Batches of preprocessed shards for one rank (see the module docstring). A subclass
    sets ``dtype`` (the record), ``num_lists`` and ``list_dtype`` before calling
    ``_init_splits``, and gives ``_read_range`` and ``_make_batch``."""

    dtype: np.dtype
    num_lists = 0
    list_dtype: Any = np.int32
    uses_shift = False

    def _init_splits(self, path: str, splits: dict[str, list[list[int]]], *, batch_size: int, rank: int,
                     world_size: int, shuffle: bool, seed: int, window_rows: int, io_threads: int,
                     required: Sequence[str] = SPLITS) -> None:  # fmt: skip
        """``required``: the splits that must have rows (``predict`` needs only the one it
        scores; with ``train`` among them, at least one batch per rank)."""
        self.path = path
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.io_threads = io_threads
        self.splits = {name: _Split(segs) for name, segs in splits.items()}
        for name in required:
            if self.splits.get(name) is None or self.splits[name].rows == 0:
                raise ConfigError("dataset_path", f"{path}: the {name} split has no rows")
        train_rows = self.splits["train"].rows if "train" in self.splits else 0
        self.batches_per_rank = train_rows // (world_size * batch_size)
        if self.batches_per_rank == 0 and "train" in required:
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
        for (w, lo, hi, _), rows in zip(windows, self._prefetch(windows)):
            if self.shuffle:
                rows = rows.take(np.random.default_rng([self.seed, epoch, self.rank, w, 1]).permutation(hi - lo))
            for i in range(0, hi - lo, b):
                if index >= start_batch:
                    yield self._make_batch(rows.slice(i, i + b), (epoch, index))
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
        for (_, start, end, _), got in zip(windows, self._prefetch(windows)):
            for i in range(0, end - start, b):
                batch = got.slice(i, i + b)
                yield self._make_batch(batch.padded(b), None), len(batch)
                produced += 1
        pad = None
        while produced < items:
            if pad is None:
                pad = self._make_batch(self._empty().padded(b), None)
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

    def _empty(self) -> Rows:
        return Rows.concat([], self.dtype, self.num_lists, self.list_dtype) if not self.uses_shift else \
            Rows(np.zeros(0, self.dtype), [], np.zeros(0, np.int64))

    def _read_range(self, shard: int, lo: int, hi: int) -> Rows:
        raise NotImplementedError

    def _make_batch(self, rows: Rows, key: Optional[tuple[int, int]]) -> Any:
        raise NotImplementedError

    def _prefetch(self, windows: list) -> Iterator[Rows]:
        """The rows of each window, read ahead by worker threads."""
        pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="shard-read")
        queue: deque[list[Future]] = deque()

        def submit(ranges: list[tuple[int, int, int]]) -> None:
            queue.append([pool.submit(self._read_range, *r) for r in ranges])

        try:
            ahead = iter(windows)
            for _ in range(2):
                nxt = next(ahead, None)
                if nxt is not None:
                    submit(nxt[3])
            while queue:
                futures = queue.popleft()
                parts = [f.result() for f in futures]
                nxt = next(ahead, None)
                if nxt is not None:
                    submit(nxt[3])
                yield Rows.concat(parts, self.dtype, self.num_lists, self.list_dtype) if parts else self._empty()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
