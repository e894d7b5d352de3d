"""Which model folder ``serve MODEL`` scores with, and, for a published root, the versions that
follow: ``ROOT/current`` is one line naming a version folder ``ROOT/<version>/`` (``export
--publish ROOT`` writes the folder, then replaces ``current`` atomically)::

    ROOT/current            v2026-11-28T12-00-00
    ROOT/v2026-11-28T12-00-00/model_config.json, scorer.pt, ...

The server polls ``current``; a new name is loaded in the background (the serving one keeps
answering), must take the same request columns, and must score the canary rows
(:meth:`~torchrec_cloud.serving.model.ServedModel.load`); then it replaces the served model in
one assignment, which the batcher reads once per batch. A version that fails is refused with one
log line and the old one keeps serving; it is not tried again until ``current`` names another.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from torchrec_cloud import storage
from torchrec_cloud.serving import CONFIG_FILE, ServingError
from torchrec_cloud.serving.model import ServedModel
from torchrec_cloud.untrusted import UntrustedInputError, check_name, read_capped

CURRENT = "current"
CURRENT_MAX_BYTES = 4096


def is_root(path: str) -> bool:
    """``path`` is a published root (a ``current`` file, no model of its own)."""
    return not storage.exists(storage.join(path, CONFIG_FILE)) and storage.exists(storage.join(path, CURRENT))


def read_current(root: str) -> str:
    """The version folder ``ROOT/current`` names: one line, a name inside ROOT."""
    path = storage.join(root, CURRENT)
    try:
        name = read_capped(path, CURRENT_MAX_BYTES).decode("utf-8").strip()
        return check_name(name, path, "the version")
    except UnicodeDecodeError:
        raise ServingError(f"{path} is not text naming a version folder") from None
    except UntrustedInputError as e:
        raise ServingError(str(e)) from None


def first_model(source: str, runtime: str = "auto") -> ServedModel:
    """The model to serve first: ``source`` itself, or the version its ``current`` names."""
    try:
        root = is_root(source)
    except storage.StorageError as e:
        raise ServingError(str(e)) from None
    if not root:
        return ServedModel(source, runtime=runtime)
    name = read_current(source)
    return ServedModel(storage.join(source, name), version=name, runtime=runtime)


class Follower:
    """Polls ``ROOT/current`` every ``poll_s`` and swaps in each new version that passes."""

    def __init__(self, root: str, serving: Callable[[], ServedModel], swap: Callable[[ServedModel], None],
                 refused: Callable[[str, str], None], poll_s: float, runtime: str = "auto") -> None:  # fmt: skip
        self.root, self.serving, self.swap, self.refused, self.poll_s = root, serving, swap, refused, poll_s
        self.runtime = runtime
        self.stopped = threading.Event()
        self._last_refused: Optional[str] = None

    def check(self) -> None:
        """Look at ``current`` once; load, check and swap in a new version."""
        try:
            name = read_current(self.root)
        except (ServingError, storage.StorageError) as e:
            if self._last_refused != f"current:{e}":
                self._last_refused = f"current:{e}"
                self.refused("current", str(e))
            return
        old = self.serving()
        if name == old.version or name == self._last_refused:
            return
        try:
            new = ServedModel(storage.join(self.root, name), version=name, runtime=self.runtime)
            if sorted(new.columns, key=lambda c: c.name) != sorted(old.columns, key=lambda c: c.name):
                missing = sorted({c.name for c in old.columns} ^ {c.name for c in new.columns})
                why = f"columns {', '.join(missing)} differ" if missing else "a column's kind or separator differs"
                raise ServingError(f"it does not take the same request columns as {old.version} ({why})")
            new.load()
        except Exception as e:  # noqa: BLE001 - whatever fails, the version is refused and the old one serves
            self._last_refused = name
            why = str(e) if isinstance(e, (ServingError, storage.StorageError)) else f"{type(e).__name__}: {e}"
            self.refused(name, " ".join(why.split()))
            return
        self._last_refused = None
        self.swap(new)

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self.check()
