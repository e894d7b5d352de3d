"""Batches for training and evaluation: the interface the loop reads, and where batches come from.

The loop sees a :class:`DataSource`. Every rank must see the same number of batches (an
unequal count hangs the embedding all-to-all), so sources guarantee that, and the loop
still checks it (see ``train.agreed_batches``)::

    source = build_data_source(cfg, rank, world_size)
    for batch in source.train_batches_ahead(epoch, 0, workers=2, pin=True): ...
    for batch, valid_rows in source.eval_batches("val"): ...           # the whole split
    for batch, valid_rows in source.eval_batches("val", rows=131072): ...  # a fixed sample

A batch is TorchRec's ``Batch``: ``dense_features`` [B, num_dense] float32, ``labels`` [B]
float32 (0 or 1), ``sparse_features`` a KeyedJaggedTensor with one key per table in the
model's order (``--feature_names``, default ``cat_0``..), int32 lengths, and its
``length_per_key``/``offset_per_key`` counted on the host: every source builds it with
:func:`keyed_jagged_tensor`.

Where batches come from, by concept (modules of this package):

- ``synthetic``: random or planted synthetic data (the default; ``--synthetic``);
- a dataset on disk or in a bucket (``--dataset_path``), made by ``torchrec-cloud data
  preprocess`` from a schema (``schema``: the YAML file; ``tabular``: Parquet and CSV
  inputs; ``transforms``: raw values to model inputs, shared by preprocessing and
  ``predict``; ``preprocess``: the conversion; ``dataset``: its manifest) or from Criteo's
  TSV, the built-in schema (``criteo_parse``, ``criteo_preprocess``, ``criteo_format``);
  read by one reader (``shards``), whose batches are made per layout (``reader`` for a
  schema, ``criteo_reader`` for Criteo);
- your own code (``--data_source module:function``, returning a :class:`DataSource`);
- ``criteo_gen``: Criteo-format TSV with a planted signal, for tests and benchmarks;
- ``multihot``: MLPerf DCNv2's multi-hot bags (``--multi_hot_sizes``);
- ``hashing``: the deterministic hashes behind the teacher and the bags;
- ``prefetch``: batches made ahead by a background thread; a run's training batches as one
  stream, segment by segment (``TrainFeed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, Sequence

from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data.prefetch import EpochsAhead, prefetched

if TYPE_CHECKING:  # the package imports without torch: preprocessing and `data schema` need none
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

SPLITS = ("train", "val", "test")


class DataSource(Protocol):
    """What the training loop reads. Every rank must return the same counts.

    A source implements the first four methods; the last three have defaults that a source
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

    def train_stream(self, num_epochs: int, workers: int, pin: bool) -> Any:
        """The run's training batches as one stream, for ``prefetch.TrainFeed``: ``open(epoch,
        first)`` iterates ``(epoch, index, batch)`` from batch ``first`` of ``epoch`` to the end
        of epoch ``num_epochs - 1``, ``close()`` stops what makes them. By default the epochs'
        ``train_batches_ahead`` one after another."""
        return EpochsAhead(self, num_epochs, workers, pin)

    def facts(self) -> dict[str, Any]:
        """What the run's ``start`` record says about the data (nothing by default)."""
        return {}


def feature_names(num_sparse: int) -> list[str]:
    return [f"cat_{i}" for i in range(num_sparse)]


def keyed_jagged_tensor(keys: Sequence[str], values: "torch.Tensor", lengths: "torch.Tensor", stride: int) -> "KeyedJaggedTensor":
    """The sparse features of a batch: ``lengths`` [len(keys) * stride] (feature-major: every
    sample's bag of the first feature, then the second's, ...) and their ``values``, with the
    ids per feature (``length_per_key``, ``offset_per_key``) counted here, on the host.

    TorchRec's input dist needs those counts; a KJT without them has them computed where its
    lengths are, which on a GPU is a sum there and a blocking copy back (``_safe_tolist`` in
    torchrec 1.8.0 sparse/jagged_tensor.py ``_maybe_compute_length_per_key``) every batch.
    TorchRec's own Criteo loader passes both for the same reason (torchrec/datasets/criteo.py
    ``_np_arrays_to_batch``). Every source builds its KJTs here."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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
    """The source ``cfg`` names: ``--data_source``'s function, the dataset at
    ``--dataset_path`` (a schema's, or Criteo's), or synthetic data."""
    if cfg.data.data_source is not None:
        return load_data_source(cfg.data.data_source)(cfg, rank, world_size)
    if cfg.data.dataset_path is not None:
        from torchrec_cloud.data.reader import build_dataset_source

        return build_dataset_source(cfg, rank, world_size)
    from torchrec_cloud.data.synthetic import SyntheticSource

    return SyntheticSource(cfg, rank, world_size)


def with_dataset_features(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the model's features (dense count, sparse names, table sizes, pooling) set
    from ``--dataset_path``'s manifest when a schema made that dataset; else ``cfg``."""
    if cfg.data.dataset_path is None:
        return cfg
    from torchrec_cloud.data.dataset import model_features

    return model_features(cfg)


def load_data_source(spec: str) -> Any:
    """The function ``module:function`` or ``path/to/file.py:function`` names (a module is
    looked up from the current folder first, as ``python -m`` does)."""
    import importlib
    import importlib.util
    import os
    import sys

    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(f"_data_source_{abs(hash(where))}", where)
            if module_spec is None or not os.path.isfile(where):
                raise ConfigError("data_source", f"{where}: no such file")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ConfigError("data_source", f"cannot import {where!r} ({e}); run from the folder that holds it, or give file.py:function") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError("data_source", f"{where} has no function {name!r}")
    return function
