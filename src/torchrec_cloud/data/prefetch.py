"""Batches made ahead of the training step by a background thread (``--data_workers``)::

    for batch in prefetched(source.train_batches(epoch), depth=2, pin=True): ...

and a run's training batches from one stream, segment by segment (:class:`TrainFeed`).
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional, TypeVar

T = TypeVar("T")
_DONE = object()


def prefetched(items: Iterator[T], depth: int, pin: bool = False) -> Iterator[T]:
    """``items`` in the same order, made up to ``depth`` ahead by a background thread.

    Batch making is torch ops (they release the GIL) or file reads, so it overlaps the
    step: on a GPU the step is mostly asynchronous kernel launches, and a 65,536-row
    synthetic batch costs more host time than the GPU step. ``pin`` puts each batch in
    page-locked memory so its copy to the GPU is asynchronous too. An error in the thread
    is raised here, at the batch where it happened. Closing this generator (the loop ends
    a segment early) stops the thread; batches it made ahead are dropped. With ``depth`` 0
    each batch is made (and pinned) here, when it is asked for.
    """
    if depth <= 0:
        for item in items:
            # Pinned here too: the pipeline's copy to the GPU (non_blocking) is asynchronous
            # only from page-locked memory.
            yield item.pin_memory() if pin else item
        return
    made: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                made.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if pin:
                    item = item.pin_memory()
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            put(e)

    thread = threading.Thread(target=work, name="batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = made.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


class TrainFeed:
    """A run's training batches, handed out segment by segment (the loop's ``Segments``)::

        feed = TrainFeed(source.train_stream(num_epochs, workers, pin), source.num_train_batches())
        for batch in feed.segment(epoch, first, last): ...  # batches first..last-1 of epoch
        feed.close()                                         # at the end of the run

    One stream of ``(epoch, batch index, batch)`` runs from the first segment to the end of
    training, so whatever makes the batches ahead (DataLoader worker processes, a reading
    thread) is started once and goes on making the next segment's first batches while an
    evaluation or a checkpoint runs between two segments: no worker is forked again and no
    batch is made and thrown away at a segment's end. Only where a segment did not take the
    batches it was given (it stopped early: SIGTERM, a time-based checkpoint; or a rank ran
    out of an epoch) is the stream opened again where the next segment starts, its batches
    made ahead dropped.
    """

    def __init__(self, stream, batches_per_epoch: int) -> None:
        self._stream = stream  # .open(epoch, first) -> Iterator[(epoch, index, batch)]; .close()
        self._per_epoch = batches_per_epoch
        self._items: Optional[Iterator] = None
        self._pending: Optional[tuple] = None  # the next epoch's first item, read to see an epoch end
        self._next: Optional[tuple[int, int]] = None  # (epoch, index) the stream hands out next

    def segment(self, epoch: int, first: int, last: int) -> Iterator:
        """Batches ``first`` .. ``last - 1`` of ``epoch`` (fewer where the epoch ends sooner)."""
        if self._items is None or self._next != (epoch, first):
            self._reopen(epoch, first)
        for index in range(first, last):
            if self._pending is not None:
                item, self._pending = self._pending, None
            else:
                item = next(self._items, None)
            if item is None:  # the end of training
                self._next = None
                return
            at_epoch, at_index, batch = item
            if at_epoch != epoch:  # this epoch ended early on this rank
                self._pending, self._next = item, (at_epoch, at_index)
                return
            # A segment that ends its epoch is followed by the next epoch's first.
            self._next = (epoch, index + 1) if index + 1 < self._per_epoch else (epoch + 1, 0)
            yield batch

    def _reopen(self, epoch: int, first: int) -> None:
        if self._items is not None and hasattr(self._items, "close"):
            self._items.close()
        self._pending = None
        self._items = iter(self._stream.open(epoch, first))
        self._next = (epoch, first)

    def close(self) -> None:
        """Stop whatever makes the batches (worker processes end here)."""
        if self._items is not None and hasattr(self._items, "close"):
            self._items.close()
        self._items = self._pending = None
        self._stream.close()


class EpochsAhead:
    """The stream of any source (``DataSource.train_stream``): its epochs one after another,
    each read through ``train_batches_ahead`` (a reading thread where ``workers`` > 0)."""

    def __init__(self, source, num_epochs: int, workers: int, pin: bool) -> None:
        self.source, self.num_epochs, self.workers, self.pin = source, num_epochs, workers, pin

    def open(self, epoch: int, first: int) -> Iterator[tuple]:
        for e in range(epoch, self.num_epochs):
            start = first if e == epoch else 0
            made = self.source.train_batches_ahead(e, start, self.workers, self.pin)
            try:
                for index, batch in enumerate(made, start):
                    yield e, index, batch
            finally:
                if hasattr(made, "close"):
                    made.close()  # stops its reading thread

    def close(self) -> None:
        pass
