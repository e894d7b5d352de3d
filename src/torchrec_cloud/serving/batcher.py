"""One bounded queue and the one place that forms batches (Triton's dynamic batcher, in little),
in two kinds, one interface:

    batcher = Batcher(lambda: model, max_batch_size=256, max_delay_s=0.002, max_queue=64)
    threading.Thread(target=batcher.run).start()  # TurnBatcher: no thread
    if batcher.full(): ...                       # answer 503 now, before reading the request
    if batcher.submit(rows, n, done) is None:    # None: the queue is full, answer 503 now
        ...
    batcher.close()                              # score what is queued at once, then stop

:class:`TurnBatcher` (``--max_delay_ms 0``, the default) waits for nothing and has no thread:
the requests that arrive in one turn of the server's event loop are scored together after
it, on the loop's own thread, a batch (at most ``max_batch_size`` rows) a turn; what arrives
meanwhile joins the queue, so the batches grow with the load. :class:`Batcher` (``--max_delay_ms`` above
0) scores on a thread of its own: a batch starts when its first request arrives and is scored
once it holds ``max_batch_size`` rows or ``max_delay_s`` has passed since then (or at once
while closing); each request's rows and answer then cross between two threads, which costs a
small request more than its scoring (bench/RESULTS.md, 2026-11-29). Either way ``model()`` is
read once per batch, so a batch is scored, conversion included, by exactly one model version;
the queue counts requests that are waiting, not those being scored: when it holds
``max_queue``, a new request is refused at once rather than waiting without bound.
"""

from __future__ import annotations

import asyncio
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


def take_batch(queue: deque, max_batch_size: int) -> list[Item]:
    """The requests at the head of ``queue`` that fit ``max_batch_size`` rows (at least one),
    taken from it; the cancelled ones dropped."""
    batch, rows = [], 0
    while queue and (not batch or rows + queue[0].rows <= max_batch_size):
        item = queue.popleft()
        if not item.cancelled:
            batch.append(item)
            rows += item.rows
    return batch


def score_batch(model: Any, batch: list[Item], on_batch: Callable[[int], None]) -> None:
    """Score ``batch`` with ``model`` and hand each request its result (or the error raised)."""
    try:
        results = model.predict([i.table for i in batch])
    except Exception as e:  # noqa: BLE001 - answered as the server's failure, never lost
        results = [e] * len(batch)
    on_batch(sum(i.rows for i in batch))
    for item, result in zip(batch, results):
        try:
            item.done(result, model)
        except RuntimeError:  # its server's event loop has closed: no one to answer
            pass


class TurnBatcher:
    """The batches of ``--max_delay_ms 0``: a turn of the event loop's requests, scored after it
    on the loop's thread (the module's docstring). ``submit`` is called on the loop; each
    ``done`` is called there too."""

    on_loop = True

    def __init__(self, model: Callable[[], Any], max_batch_size: int, max_queue: int,
                 on_batch: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        self.model, self.max_batch_size, self.max_queue = model, max_batch_size, max_queue
        self.on_batch = on_batch or (lambda rows: None)
        self._queue: deque[Item] = deque()
        self._scheduled = False

    def submit(self, table: Any, rows: int, done: Callable[[Any, Any], None]) -> Optional[Item]:
        if len(self._queue) >= self.max_queue:
            return None
        item = Item(table, rows, done)
        self._queue.append(item)
        if not self._scheduled:  # call_soon: after the I/O callbacks of this turn, which queue the rest
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.score)
        return item

    def score(self) -> None:
        """Score one batch of what is queued (at most ``max_batch_size`` rows); the rest in
        the next turn, after the loop's I/O: the loop answers, reads and accepts between
        batches, so a turn that queued many rows holds nothing up longer than one batch."""
        batch = take_batch(self._queue, self.max_batch_size)
        if self._queue:
            asyncio.get_running_loop().call_soon(self.score)
        else:
            self._scheduled = False
        if batch:
            score_batch(self.model(), batch, self.on_batch)

    def cancel(self, item: Item) -> None:
        item.cancelled = True

    def full(self) -> bool:
        return len(self._queue) >= self.max_queue

    def depth(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Nothing waits longer than its turn: nothing to hurry."""

    def stop(self) -> None:
        pass

    def run(self) -> None:
        pass


class Batcher:
    on_loop = False

    def __init__(self, model: Callable[[], Any], max_batch_size: int, max_delay_s: float, max_queue: int,
                 on_batch: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        self.model = model
        self.max_batch_size, self.max_delay_s, self.max_queue = max_batch_size, max_delay_s, max_queue
        self.on_batch = on_batch or (lambda rows: None)
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
            self._cv.notify()
            return item

    def cancel(self, item: Item) -> None:
        """A request given up (its timeout): out of the queue if it is still there."""
        with self._cv:
            item.cancelled = True
            try:
                self._queue.remove(item)
            except ValueError:  # taken into a batch already: scored, its answer dropped
                pass

    def full(self) -> bool:
        """Whether a request submitted now would be refused (read without the lock: a request
        that passes here can still find the queue full at :meth:`submit`)."""
        return len(self._queue) >= self.max_queue

    def depth(self) -> int:
        """The requests waiting (a length is read whole: no lock)."""
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
            batch = take_batch(self._queue, self.max_batch_size)
            return batch

    def run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                score_batch(self.model(), batch, self.on_batch)
