"""Versions of a model under one root, and the ``current`` file that names the one to serve::

    torchrec-cloud export runs/q/checkpoints --publish models/q
    torchrec-cloud export s3://bucket/runs/q/checkpoints --publish s3://bucket/models/q

lays out::

    ROOT/20261128T161500123456Z-step00002000/   a complete model folder (serving/__init__.py)
    ROOT/20261129T020000000000Z-step00004000/
    ROOT/current                                one line: the name of the folder to serve

A version's name is the UTC time it was published and its checkpoint's step: names sort in
publishing order and two publishes never share one. The version's ``model_config.json``
records its ``lineage``: the version, its parent (the version ``current`` named before), the
checkpoint (path and step), the dataset (path, the digest of its manifest and of its
vocabulary) when known, and the gate it passed.

``--gate DATASET`` checks the new model before it serves (the daily loop, docs/daily.md):
DATASET's test split is scored by the model ``current`` names and by the new one, and the new
one is published only if its AUC is not lower by more than ``--tolerance``; else a
:class:`GateError` (exit 1) names both AUCs and ``current`` is left as it was. The gate runs
before anything is written under ROOT. With no ``current`` yet, the first version passes.

A gated publish of the checkpoint ``current`` already serves does nothing (a daily job rerun
after a lost pod publishes once); a version of it that was written but never named by
``current`` (a pod lost between the two), with ``current`` still its parent, is named then.

Nothing half-written is ever named by ``current``. On a local disk the version is exported
into ``ROOT/.tmp-<version>`` and renamed into place, then ``current`` is replaced by a
rename (atomic); in a bucket (which has no rename) the version's files are written first,
its ``model_config.json`` last, and ``current`` after it. A reader (``serve ROOT``) reads
``current`` with :func:`read_current` and loads that folder; publishing a version never
touches the folder ``current`` named before, so a server still loading it is undisturbed.
Two publishes to one root at the same moment both write their versions; the later rename of
``current`` wins, and its ``parent`` may name the version the other published.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

from torchrec_cloud import checksum, storage
from torchrec_cloud.serving import CONFIG_FILE, ServingError
from torchrec_cloud.untrusted import UntrustedInputError, check_name, read_capped

CURRENT_FILE = "current"
CURRENT_MAX_BYTES = 4096
TEMP_PREFIX = ".tmp-"


def version_name(step: int, now: Optional[datetime.datetime] = None) -> str:
    """A version folder's name: the UTC time to the microsecond, then the checkpoint's step."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{now.strftime('%Y%m%dT%H%M%S%fZ')}-step{step:08d}"


def read_current(root: str) -> Optional[str]:
    """The version ``ROOT/current`` names (checked to be a folder name inside ROOT), or None
    when the root has no ``current`` yet."""
    path = storage.join(root, CURRENT_FILE)
    try:
        data = read_capped(path, CURRENT_MAX_BYTES)
    except storage.StorageNotFoundError:
        return None
    except UntrustedInputError as e:
        raise ServingError(str(e)) from None
    try:
        name = data.decode("utf-8").strip()
        return check_name(name, path, "version")
    except (UnicodeDecodeError, UntrustedInputError) as e:
        raise ServingError(f"{path}: not one line naming a version folder ({e})") from None


def current_model(root: str) -> Optional[str]:
    """The model folder ``ROOT/current`` names, or None when ROOT has no ``current`` (then
    ROOT may be a model folder itself)."""
    version = read_current(root)
    return None if version is None else storage.join(root, version)


def dataset_lineage(dataset_path: Optional[str]) -> Optional[dict[str, Any]]:
    """The dataset a checkpoint was trained on: its path and the digest of its manifest
    (None when the run used synthetic data; the digest None when the manifest is unreadable)."""
    if dataset_path is None:
        return None
    from torchrec_cloud.data.dataset import MANIFEST, MAX_MANIFEST_BYTES

    try:
        digest = checksum.digest(read_capped(storage.join(dataset_path, MANIFEST), MAX_MANIFEST_BYTES))
    except (storage.StorageError, UntrustedInputError):
        digest = None  # a raw Criteo file, or a dataset since moved: the path still says which
    vocabulary = None
    try:
        from torchrec_cloud.data.dataset import is_schema_dataset, read_manifest
        from torchrec_cloud.data.vocab import vocabulary_section

        manifest = read_manifest(dataset_path)
        if is_schema_dataset(manifest):
            section = vocabulary_section(manifest, storage.join(dataset_path, MANIFEST))
            vocabulary = {"version": section["version"], "digest": section["digest"]}
    except (ValueError, storage.StorageError, UntrustedInputError):
        pass  # as for the digest: the path still says which
    return {"path": dataset_path, "manifest_digest": digest, "vocabulary": vocabulary}


DEFAULT_TOLERANCE = 0.002
"""How much lower the new model's test AUC may be than the serving one's: about the run-to-run
spread of a day's retraining (seeds, data order) on the test split of a day, so that noise
alone does not hold back every other day's model, while a model that learned less (a day of
broken data, a short run) is refused."""


def check_version(root: str, version: str) -> None:
    """A ServingError unless ``ROOT/version`` is a complete model folder (its config, written
    last, is there)."""
    if not storage.exists(storage.join(root, version, CONFIG_FILE)):
        raise ServingError(f"{storage.join(root, CURRENT_FILE)} names {version}, which has no {CONFIG_FILE}")
