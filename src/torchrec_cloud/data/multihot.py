"""Multi-hot categorical features in the MLPerf DLRM-DCNv2 style.

MLPerf's DCNv2 benchmark turns each one-hot Criteo id into a bag of ids: the id itself
followed by ``size - 1`` ids that are a fixed function of (feature, id), so a bag carries
the same signal as its id and the same id always gives the same bag. Pooling is ``fixed``
(every bag has ``size`` ids, as in MLPerf) or ``random`` (each bag keeps its first
1..size ids, drawn per sample). MLPerf's bag sizes are :data:`MLPERF_MULTI_HOT_SIZES`::

    kjt = expand_multi_hot(ids, sizes=MLPERF_MULTI_HOT_SIZES, num_embeddings=table_sizes,
                           generator=torch.Generator().manual_seed(0))

MLPerf materialises a lookup table per feature (rows x size ids, gigabytes for 40M-row
tables); here the extra ids come from a hash of (feature, id, slot), which needs no memory
and gives ids uniform over each table, as MLPerf's ``uniform`` distribution does.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cloud.config import MLPERF_MULTI_HOT_SIZES
from torchrec_cloud.data.source import keyed_jagged_tensor
from torchrec_cloud.data.hashing import mix

__all__ = ["MLPERF_MULTI_HOT_SIZES", "expand_multi_hot", "validate_sizes"]

def validate_sizes(sizes: Sequence[int], num_features: int) -> None:
    """Raise :class:`~torchrec_cloud.config.ConfigError` for bag sizes that cannot be used."""
    from torchrec_cloud.config import ConfigError

    if len(sizes) != num_features:
        raise ConfigError(
            "multi_hot_sizes",
            f"needs one bag size per sparse feature ({num_features}), got {len(sizes)}",
        )
    if min(sizes) < 1:
        raise ConfigError("multi_hot_sizes", f"every bag size must be >= 1, got {list(sizes)}")


def expand_multi_hot(
    ids: torch.Tensor,
    sizes: Sequence[int],
    num_embeddings: Sequence[int],
    generator: Optional[torch.Generator] = None,
    pooling: Literal["fixed", "random"] = "fixed",
    keys: Optional[list[str]] = None,
) -> KeyedJaggedTensor:
    """Bags of ids from one id per (sample, feature).

    Args:
        ids: ``[B, F]`` int64, one id per sample and feature (each within its table).
        sizes: bag size per feature (``F`` values >= 1); the first id of a bag is the id.
        num_embeddings: rows of each feature's table; derived ids are taken modulo it.
        generator: draws the bag lengths for ``random`` pooling (unused for ``fixed``).
        pooling: ``fixed`` (every bag has ``size`` ids) or ``random`` (1..size ids).
        keys: feature names; default ``cat_0`` .. ``cat_{F-1}``.

    Returns:
        A KeyedJaggedTensor with keys in feature order, int32 lengths and int64 values.
    """
    b, f = ids.shape
    if len(sizes) != f or len(num_embeddings) != f:
        raise ValueError(f"ids have {f} features but sizes/num_embeddings have {len(sizes)}/{len(num_embeddings)}")
    keys = keys or [f"cat_{i}" for i in range(f)]
    ids = ids.to(torch.int64)
    values, lengths = [], []
    for j in range(f):
        s, n = int(sizes[j]), int(num_embeddings[j])
        col = ids[:, j]
        if s == 1:
            bag = col[:, None]
        else:
            slot = torch.arange(1, s, dtype=torch.int64)
            derived = mix(col[:, None] * 4099 + (j * 1_000_003 + slot)[None, :] * 0x2545F491)
            bag = torch.cat([col[:, None], torch.remainder(derived, n)], dim=1)
        if pooling == "fixed" or s == 1:
            values.append(bag.reshape(-1))
            lengths.append(torch.full((b,), s, dtype=torch.int32))
        else:
            n_keep = torch.randint(1, s + 1, (b,), generator=generator, dtype=torch.int64)
            mask = torch.arange(s)[None, :] < n_keep[:, None]
            values.append(bag[mask])
            lengths.append(n_keep.to(torch.int32))
    return keyed_jagged_tensor(keys, torch.cat(values), torch.cat(lengths), b)
