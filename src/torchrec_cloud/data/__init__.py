"""Batches for training and evaluation: the interface the loop reads, and where batches come from.

The loop sees a :class:`DataSource`. Every rank must see the same number of batches (an
unequal count hangs the embedding all-to-all), so sources guarantee that, and the loop
still checks it (see ``train.agreed_batches``)::

    source = build_data_source(cfg, rank, world_size)
    for batch in source.train_batches_ahead(epoch, 0, workers=2, pin=True): ...
    for batch, valid_rows in source.eval_batches("val"): ...           # the whole split
    for batch, valid_rows in source.eval_batches("val", rows=131072): ...  # a fixed sample

The interface lives in ``source`` (re-exported here). A batch is TorchRec's ``Batch``:
``dense_features`` [B, num_dense] float32, ``labels`` [B] float32 (0 or 1),
``sparse_features`` a KeyedJaggedTensor with one key per table in the model's order
(``--feature_names``, default ``cat_0``..), int32 lengths, and its ``length_per_key``/
``offset_per_key`` counted on the host: every source builds it with
:func:`keyed_jagged_tensor`.

Where batches come from, by concept (modules of this package):

- ``synthetic``: random or planted synthetic data (the default; ``--synthetic``);
- a dataset on disk or in a bucket (``--dataset_path``), made by ``torchrec-cloud data
  preprocess`` from a schema (``schema``: the YAML file; ``tabular``: Parquet and CSV
  inputs; ``transforms``: raw values to model inputs, shared by preprocessing and
  ``predict``; ``preprocess``: the one preprocessor, for every input format;
  ``conversion``: what every input format's run shares, the manifest written last;
  ``dataset``: its manifest, one format for every schema) or from Criteo's TSV, the built-in
  schema, one input format of that preprocessor (``criteo_tsv``, ``criteo_parse``,
  ``criteo_format``); read by one reader (``reader``, rows reaching
  ranks by ``shards``), whose batches are made per record (``reader.batch_of`` for a schema's,
  ``criteo_reader.CriteoBatcher`` for Criteo's);
- your own code (``--data_source module:function``, returning a :class:`DataSource`);
- ``criteo_gen``: Criteo-format TSV with a planted signal, for tests and benchmarks;
- ``multihot``: MLPerf DCNv2's multi-hot bags (``--multi_hot_sizes``);
- ``hashing``: the deterministic hashes behind the teacher and the bags;
- ``prefetch``: batches made ahead by a background thread; a run's training batches as one
  stream, segment by segment (``TrainFeed``).
"""

from __future__ import annotations

from typing import Any

from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.data.source import SPLITS, DataSource, feature_names, keyed_jagged_tensor

__all__ = ["SPLITS", "DataSource", "build_data_source", "feature_names", "keyed_jagged_tensor", "load_data_source",
           "with_dataset_features"]


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
