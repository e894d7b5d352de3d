"""Batches made ahead of the training step by a background thread (``--data_workers``)::

    for batch in prefetched(source.train_batches(epoch), depth=2, pin=True): ...
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

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
