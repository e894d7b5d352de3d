"""The interface the training loop reads: :class:`DataSource`, the splits, and
:func:`keyed_jagged_tensor`, the one builder of a batch's sparse features.

Its own module, below every source (``synthetic``, ``reader``, ``criteo_reader``,
``shards``, ``multihot``), so that they import it and the package's ``__init__`` (which
re-exports it and picks a source) without an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, Sequence

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
