"""Batches for training and evaluation: the interface the loop reads, and where batches come from.

The loop sees a :class:`DataSource`. Every rank must see the same number of batches (an
unequal count hangs the embedding all-to-all), so sources guarantee that, and the loop
still checks it (see ``train.agreed_batches``)::

    source = build_data_source(cfg, rank, world_size)
    for batch in source.train_batches_ahead(epoch, 0, workers=2, pin=True): ...
    for batch, valid_rows in source.eval_batches("val"): ...

The modules of this package, by concept:

- ``synthetic``: random or planted synthetic data (the default; ``--synthetic``);
- ``criteo_parse``, ``criteo_preprocess``, ``criteo_format``: Criteo TSV to binary shards
  and their manifest (``torchrec-cloud data preprocess``, ``cli``);
- ``criteo_reader``: those shards as a data source (``--dataset_path``);
- ``criteo_gen``: Criteo-format TSV with a planted signal, for tests and benchmarks;
- ``multihot``: MLPerf DCNv2's multi-hot bags (``--multi_hot_sizes``);
- ``hashing``: the deterministic hashes behind the teacher and the bags;
- ``prefetch``: batches made ahead by a background thread.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

from torchrec.datasets.utils import Batch

from torchrec_cloud.config import JobConfig
from torchrec_cloud.data.prefetch import prefetched

SPLITS = ("train", "val", "test")


class DataSource(Protocol):
    """What the training loop reads. Every rank must return the same counts.

    A source implements the first three methods; the last two have defaults that a source
    may override (a class that names ``DataSource`` as its base inherits them).
    """

    def num_train_batches(self) -> int:
        """Training batches per rank per epoch."""
        ...

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """Training batches of ``epoch`` for this rank, from ``start_batch`` on (resume)."""
        ...

    def eval_batches(self, split: str) -> Iterator[tuple[Batch, int]]:
        """``(batch, valid_rows)`` of a held-out split; only the first valid_rows count."""
        ...

    def train_batches_ahead(self, epoch: int, start_batch: int, workers: int, pin: bool) -> Iterator[Batch]:
        """``train_batches``, made ahead of the step where ``workers`` > 0 (by one reading
        thread here), ``pin``-ned for an asynchronous copy to a GPU; with 0, each batch is
        made when the step asks for it. Closing the generator stops whatever makes them."""
        yield from prefetched(self.train_batches(epoch, start_batch), 2 if workers else 0, pin)

    def facts(self) -> dict[str, Any]:
        """What the run's ``start`` record says about the data (nothing by default)."""
        return {}


def feature_names(num_sparse: int) -> list[str]:
    return [f"cat_{i}" for i in range(num_sparse)]


def build_data_source(cfg: JobConfig, rank: int, world_size: int) -> DataSource:
    """Synthetic data, or preprocessed Criteo shards when ``--dataset_path`` is set."""
    if cfg.data.dataset_path is not None:
        from torchrec_cloud.data.criteo_reader import build_criteo_source

        return build_criteo_source(cfg, rank, world_size)
    from torchrec_cloud.data.synthetic import SyntheticSource

    return SyntheticSource(cfg, rank, world_size)

