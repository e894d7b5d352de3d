"""What every input format of the one preprocessor shares (``data preprocess``,
:mod:`~torchrec_cloud.data.preprocess`: a schema's Parquet/CSV, Criteo's TSV in
:mod:`~torchrec_cloud.data.criteo_tsv`): the plan that a resumed run must match
(:func:`prepare`), the records a run commits read back as input (:func:`read_record`), the
worker processes that convert inputs, or parts of them, with their rows reported to one
progress bar (:func:`run_each`), and the manifest written from every shard's record
(:func:`write_manifest`)::

    done = prepare(output, plan, check)          # the finished manifest, or None
    results = run_each(convert, opts, tasks, (), workers, progress)
    manifest = write_manifest(output, sections, shard_records, sources, examples)
"""

from __future__ import annotations

import json
import multiprocessing as mp
from typing import Any, Callable, Optional, Sequence

from torchrec_cloud import storage
from torchrec_cloud.data.criteo_parse import PreprocessError
from torchrec_cloud.data.dataset import FORMAT_NAME, FORMAT_VERSION, MANIFEST, MAX_MANIFEST_BYTES, SPLITS
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


def write_manifest(output: str, sections: dict, records: list[dict], sources: list[dict], examples: list[str],
                   skipped_key: str = "skipped_rows") -> dict:  # fmt: skip
    """The manifest of the dataset at ``output``, written last: the input format's ``sections``
    (schema, record, features, transforms, ...), the shards with rows (from every shard's
    ``records`` in row order, each with its rows of train, val and test, stored in that order)
    and each split's ``[shard, first row, end row]`` segments, the ``sources`` (each with its
    ``skipped_rows``) and the first skipped rows; ``skipped_key`` also names their count."""
    shards: list[dict] = []
    splits: dict[str, list[list[int]]] = {s: [] for s in SPLITS}
    for e in records:
        if e["rows"] == 0:
            continue
        k, lo = len(shards), 0
        shards.append(e)
        for split, n in zip(SPLITS, e["splits"]):
            if n:
                splits[split].append([k, lo, lo + n])
            lo += n
    skipped = sum(s["skipped_rows"] for s in sources)
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **sections, "rows": sum(e["rows"] for e in shards),
                "skipped_rows": skipped, skipped_key: skipped, "skipped_examples": examples[:20], "sources": sources,
                "shards": shards, "splits": splits}  # fmt: skip
    if manifest["rows"] == 0:
        raise PreprocessError("no rows were converted: every row was skipped as bad")
    storage.write_bytes(storage.join(output, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest
