"""Batches for training and evaluation: the interface the loop reads, and where batches come from.

The loop sees a :class:`DataSource`. Every rank must see the same number of batches (an
unequal count hangs the embedding all-to-all), so sources guarantee that, and the loop
still checks it (see ``train.agreed_batches``)::

    source = build_data_source(cfg, rank, world_size)
    for batch in source.train_batches_ahead(epoch, 0, workers=2, pin=True): ...
    for batch, valid_rows in source.eval_batches("val"): ...           # the whole split
    for batch, valid_rows in source.eval_batches("val", rows=131072): ...  # a fixed sample

A batch's sparse features are built by :func:`keyed_jagged_tensor` (counts per feature
known on the host), whatever the source.

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

from typing import Any, Iterator, Optional, Protocol, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cloud.config import JobConfig
from torchrec_cloud.data.prefetch import prefetched

SPLITS = ("train", "val", "test")


class DataSource(Protocol):
    """What the training loop reads. Every rank must return the same counts.

    A source implements the first four methods; the last two have defaults that a source
    may override (a class that names ``DataSource`` as its base inherits them).
    """

    def num_train_batches(self) -> int:
        """Training batches per rank per epoch."""
        ...

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """Training batches of ``epoch`` for this rank, from ``start_batch`` on (resume)."""
        ...

    def eval_batches(self, split: str, rows: Optional[int] = None) -> Iterator[tuple[Batch, int]]:
        """``(batch, valid_rows)`` of a held-out split; only the first valid_rows count. With
        ``rows`` (fewer than the split has), a sample of that many of its rows instead, the
        same rows on every call and on any number of ranks (``--eval_rows``)."""
        ...

    def num_eval_rows(self, split: str) -> int:
        """Rows of a held-out split (what ``eval_batches(split)`` scores)."""
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


def keyed_jagged_tensor(keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor, stride: int) -> KeyedJaggedTensor:
    """The sparse features of a batch: ``lengths`` [len(keys) * stride] (feature-major: every
    sample's bag of the first feature, then the second's, ...) and their ``values``, with the
    ids per feature (``length_per_key``, ``offset_per_key``) counted here, on the host.

    TorchRec's input dist needs those counts; a KJT without them has them computed where its
    lengths are, which on a GPU is a sum there and a blocking copy back (``_safe_tolist`` in
    torchrec 1.8.0 sparse/jagged_tensor.py ``_maybe_compute_length_per_key``) every batch.
    TorchRec's own Criteo loader passes both for the same reason (torchrec/datasets/criteo.py
    ``_np_arrays_to_batch``). Every source builds its KJTs here."""
    if lengths.device.type != "cpu":
        raise ValueError("keyed_jagged_tensor: lengths must be on the host, where they are counted")
    length_per_key = lengths.view(len(keys), stride).sum(dim=1).tolist() if len(keys) else []
    offset_per_key = [0]
    for n in length_per_key:
        offset_per_key.append(offset_per_key[-1] + n)
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=lengths,
        stride=stride,
        length_per_key=length_per_key,
        offset_per_key=offset_per_key,
    )


def build_data_source(cfg: JobConfig, rank: int, world_size: int) -> DataSource:
    """Synthetic data, or preprocessed Criteo shards when ``--dataset_path`` is set."""
    if cfg.data.dataset_path is not None:
        from torchrec_cloud.data.criteo_reader import build_criteo_source

        return build_criteo_source(cfg, rank, world_size)
    from torchrec_cloud.data.synthetic import SyntheticSource

    return SyntheticSource(cfg, rank, world_size)

