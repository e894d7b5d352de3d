"""One bounded queue and the one place that forms batches (Triton's dynamic batcher, in little):

    batcher = Batcher(lambda: model, max_batch_size=256, max_delay_s=0.002, max_queue=64)
    threading.Thread(target=batcher.run).start()
    if batcher.full(): ...                       # answer 503 now, before reading the request
    if batcher.submit(rows, n, done) is None:    # None: the queue is full, answer 503 now
        ...
    batcher.close()                              # score what is queued at once, then stop

A batch starts when its first request arrives and is scored once it holds ``max_batch_size``
rows or ``max_delay_s`` has passed since then (or at once while closing). ``model()`` is read
once per batch, so a batch is scored, conversion included, by exactly one model version.
The queue counts requests that are waiting, not those being scored: when it holds
``max_queue``, a new request is refused at once rather than waiting without bound.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class Item:
    table: Any
    """What ``model().predict`` takes: a table, or the request's values (serving.model.ValueRows)."""
    rows: int
    done: Callable[[Any, Any], None]
    """Called from the batcher's thread with (result, model): the probabilities or the error."""
    queued_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False


class Batcher:
    def __init__(self, model: Callable[[], Any], max_batch_size: int, max_delay_s: float, max_queue: int,
                 on_batch: Optional[Callable[[int], None]] = None,
                 on_depth: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        self.model = model
        self.max_batch_size, self.max_delay_s, self.max_queue = max_batch_size, max_delay_s, max_queue
        self.on_batch = on_batch or (lambda rows: None)
        self.on_depth = on_depth or (lambda depth: None)
        self._queue: deque[Item] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._stopped = False

    def submit(self, table: Any, rows: int, done: Callable[[Any, Any], None]) -> Optional[Item]:
        """Queue a request: its Item, or None when the queue is full."""
        with self._cv:
            if len(self._queue) >= self.max_queue:
                return None
            item = Item(table, rows, done)
            self._queue.append(item)
            self.on_depth(len(self._queue))
            self._cv.notify()
            return item

    def cancel(self, item: Item) -> None:
        """A request given up (its timeout): out of the queue if it is still there."""
        with self._cv:
            item.cancelled = True
            try:
                self._queue.remove(item)
            except ValueError:  # taken into a batch already: scored, its answer dropped
                return
            self.on_depth(len(self._queue))

    def full(self) -> bool:
        """Whether a request submitted now would be refused (read without the lock: a request
        that passes here can still find the queue full at :meth:`submit`)."""
        return len(self._queue) >= self.max_queue

    def depth(self) -> int:
        with self._cv:
            return len(self._queue)

    def close(self) -> None:
        """Stop waiting for batches to fill: what is queued (and what still comes) is scored at once."""
        with self._cv:
            self._closing = True
            self._cv.notify()

    def stop(self) -> None:
        """Score what is queued, then let :meth:`run` return."""
        with self._cv:
            self._closing = self._stopped = True
            self._cv.notify()

    def _next_batch(self) -> Optional[list[Item]]:
        with self._cv:
            while True:
                while self._queue and self._queue[0].cancelled:
                    self._queue.popleft()
                if self._queue:
                    rows = sum(i.rows for i in self._queue)
                    wait = self._queue[0].queued_at + self.max_delay_s - time.monotonic()
                    if rows >= self.max_batch_size or wait <= 0 or self._closing:
                        break
                    self._cv.wait(wait)
                elif self._stopped:
                    return None
                else:
                    self._cv.wait()
            batch, rows = [], 0
            while self._queue and (not batch or rows + self._queue[0].rows <= self.max_batch_size):
                item = self._queue.popleft()
                if not item.cancelled:
                    batch.append(item)
                    rows += item.rows
            self.on_depth(len(self._queue))
            return batch

    def run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:
                continue
            model = self.model()
            try:
                results = model.predict([i.table for i in batch])
            except Exception as e:  # noqa: BLE001 - answered as the server's failure, never lost
                results = [e] * len(batch)
            self.on_batch(sum(i.rows for i in batch))
            for item, result in zip(batch, results):
                try:
                    item.done(result, model)
                except RuntimeError:  # its server's event loop has closed: no one to answer
                    pass
