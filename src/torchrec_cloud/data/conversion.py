"""What every input format's preprocessing run shares (``data preprocess``, a schema's
Parquet/CSV in :mod:`~torchrec_cloud.data.preprocess`, Criteo's TSV in
:mod:`~torchrec_cloud.data.criteo_preprocess`): the plan that a resumed run must match
(:func:`prepare`), the records a run commits read back as input (:func:`read_record`), and the
worker processes that convert inputs, or parts of them, with their rows reported to one
progress bar (:func:`run_each`)::

    done = prepare(output, plan, check)          # the finished manifest, or None
    results = run_each(convert, opts, tasks, (), workers, progress)
"""

from __future__ import annotations

import json
import multiprocessing as mp
from typing import Any, Callable, Optional, Sequence

from torchrec_cloud import storage
from torchrec_cloud.data.criteo_parse import PreprocessError
from torchrec_cloud.data.dataset import MANIFEST, MAX_MANIFEST_BYTES
from torchrec_cloud.untrusted import UntrustedInputError, read_json, shown

PLAN = "_plan.json"


def read_record(url: str) -> Any:
    """A record this command wrote (plan, marker, manifest), read as input (a bucket may hold
    anything): damaged or oversized bytes are a one-line error."""
    try:
        return read_json(url, MAX_MANIFEST_BYTES)
    except UntrustedInputError as e:
        raise PreprocessError(f"{url} is damaged ({e.problem.removeprefix('is ')}); delete it, or use another "
                              "--output") from None  # fmt: skip


def prepare(output: str, plan: dict, finished: Callable[[Any], dict]) -> Optional[dict]:
    """Check ``output``'s plan against ``plan`` (what its shards depend on; a run with other
    settings is refused), or write it; the finished manifest, checked by ``finished``, when
    there is one. Every input format's run starts here."""
    storage.makedirs(output)
    plan_url = storage.join(output, PLAN)
    if not storage.exists(plan_url):
        storage.write_bytes(plan_url, json.dumps(plan, indent=1).encode())
        return None
    old = read_record(plan_url)
    if not isinstance(old, dict):
        raise PreprocessError(f"{plan_url} is not a JSON object; delete it, or use another --output")
    if old != plan:
        changed = sorted(str(k) for k in set(old) | set(plan) if old.get(k) != plan.get(k))
        raise PreprocessError(f"{output} holds a preprocessing run with different settings "
                              f"({shown(', '.join(changed), 200)}); use another --output or delete that one")  # fmt: skip
    manifest_url = storage.join(output, MANIFEST)
    if not storage.exists(manifest_url):
        return None
    try:
        return finished(read_record(manifest_url))
    except UntrustedInputError as e:
        raise PreprocessError(f"{e}; delete it, or use another --output") from None


def run_each(fn: Callable, opts: Any, items: Sequence[Any], extra: tuple, workers: int, progress: Any,
             method: str = "spawn") -> list[Any]:  # fmt: skip
    """``fn(opts, item, *extra, report)`` for each item (an input, or a part of one), in
    ``workers`` processes started by ``method``, rows reported to ``progress``; their results
    in order. Every input format's conversion runs here."""
    if workers <= 1 or len(items) <= 1:
        return [fn(opts, item, *extra, progress.update) for item in items]
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    with ctx.Pool(min(workers, len(items)), initializer=_init_worker, initargs=(queue,)) as pool:
        pending = pool.starmap_async(_in_worker, [(fn, opts, item, extra) for item in items], chunksize=1)
        while True:
            while not queue.empty():
                progress.update(queue.get())
            if pending.ready():
                break
            pending.wait(0.2)
        results = pending.get()
    while not queue.empty():  # reports sent just before the last task ended
        progress.update(queue.get())
    return results


_queue: Any = None


def _init_worker(queue: Any) -> None:
    global _queue
    _queue = queue


def _in_worker(fn: Callable, opts: Any, item: Any, extra: tuple) -> Any:
    return fn(opts, item, *extra, _queue.put)
