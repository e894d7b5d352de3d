"""Publishing a checkpoint as a new version of a served model, checked first
(``export CKPT --publish ROOT [--gate DATASET --tolerance T]``): the layout of ROOT and the
``current`` file are :mod:`.publish`'s; the gate and its lineage are here, between
:mod:`.export` (which writes one model folder) and :mod:`.publish` (which names versions), so
each module's imports point one way.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from torchrec_cloud import storage
from torchrec_cloud.serving import CONFIG_FILE, ServingError
from torchrec_cloud.serving.export import export, find_checkpoint, job_config, scorer_module, unsharded_model
from torchrec_cloud.serving.publish import (
    CURRENT_FILE,
    DEFAULT_TOLERANCE,
    TEMP_PREFIX,
    check_version,
    dataset_lineage,
    read_current,
    version_name,
)
from torchrec_cloud.untrusted import UntrustedInputError


def _lineage_of(root: str, version: str) -> Optional[dict[str, Any]]:
    """The lineage a version's model_config.json records; None when it has none or is not a
    complete version."""
    from torchrec_cloud.serving import read_model_config

    try:
        lineage = read_model_config(storage.join(root, version)).get("lineage")
    except (ServingError, storage.StorageError, UntrustedInputError):
        return None
    return lineage if isinstance(lineage, dict) else None


def _same_checkpoint(lineage: Optional[dict[str, Any]], info: Any) -> bool:
    ck = (lineage or {}).get("checkpoint") or {}
    return ck.get("path") == info.path and ck.get("step") == info.step


def _published_before(root: str, current: Optional[str], info: Any, log) -> Optional[dict[str, Any]]:
    """The model config of the version of ``info`` that ``current`` names (nothing to do), or
    of one written but not yet named, whose parent is still ``current`` (``current`` is then
    made to name it); None: publish it."""
    from torchrec_cloud.serving import read_model_config

    if current is not None and _same_checkpoint(_lineage_of(root, current), info):
        log(f"{storage.join(root, current)} is checkpoint {info.path} (step {info.step}) already: nothing to publish")
        return read_model_config(storage.join(root, current))
    try:
        names = sorted(n.rstrip("/") for n in storage.listdir(root))
    except storage.StorageError:
        return None
    for name in reversed(names):
        if name == CURRENT_FILE or name.startswith(TEMP_PREFIX) or name == current:
            continue
        lineage = _lineage_of(root, name)
        if _same_checkpoint(lineage, info) and lineage.get("parent") == current:
            storage.write_bytes(storage.join(root, CURRENT_FILE), f"{name}\n".encode())
            log(f"published {storage.join(root, name)} (written before, not yet named); "
                f"{storage.join(root, CURRENT_FILE)} names it")  # fmt: skip
            return read_model_config(storage.join(root, name))
    return None


def check_gate(info: Any, cfg: Any, root: str, current: Optional[str], gate: str, tolerance: float, quantize: str,
               eval_rows: int, log) -> dict[str, Any]:  # fmt: skip
    """Score ``gate``'s test split (``eval_rows`` at most) with the model ``current`` names and
    with ``info``'s (as it will be published: ``quantize``); a :class:`GateError` when the new
    AUC is lower than the current one by more than ``tolerance``; else what the lineage records.
    Both models read the dataset's rows as they are: the daily loop's datasets keep every id's
    row from one day to the next (docs/daily.md), so the serving model sees the ids it knows."""
    import math

    from torchrec_cloud.evaluation import binary_metrics

    record: dict[str, Any] = {"dataset": gate, "split": "test", "tolerance": tolerance, "current": current}
    if current is None:
        log(f"gate: {storage.join(root, CURRENT_FILE)} names no model yet: the first version is published unchecked")
        return record
    current_dir = storage.join(root, current)
    check_version(root, current)
    new_scorer = scorer_module(unsharded_model(info, cfg), quantize)
    aucs = {}
    for name, (scorer, model_cfg) in {"new": (new_scorer, cfg.model), "current": _served_scorer(current_dir)}.items():
        logits, labels, _ = _score(scorer, model_cfg, gate, eval_rows)
        aucs[name], record["rows"] = binary_metrics(logits, labels)["auc"], int(labels.numel())
    record.update(auc=aucs["new"], current_auc=aucs["current"])
    if not all(math.isfinite(a) for a in aucs.values()):
        raise GateError(f"gate: the test split of {gate} has one class only: AUC undefined, nothing to compare")
    if aucs["new"] < aucs["current"] - tolerance:
        raise GateError(f"gate: the new model (checkpoint {info.path}, step {info.step}) has test AUC {aucs['new']:.5f} "
                        f"on {gate}, the current one ({current}) {aucs['current']:.5f}: lower by more than --tolerance "
                        f"{tolerance:g}; not published, {storage.join(root, CURRENT_FILE)} still names {current}")  # fmt: skip
    log(f"gate: test AUC on {gate}: new {aucs['new']:.5f}, current ({current}) {aucs['current']:.5f} "
        f"(--tolerance {tolerance:g}): passed")  # fmt: skip
    return record


def _served_scorer(model_dir: str) -> tuple[Any, Any]:
    """The scorer of the model folder ``current`` names and its model config."""
    from torchrec_cloud.serving import SCORER_FILE, read_model_config, saved_job_config
    from torchrec_cloud.serving.predict import load_scorer

    config = read_model_config(model_dir)
    cfg = saved_job_config(config, storage.join(model_dir, CONFIG_FILE))
    if SCORER_FILE in config["files"]:
        return load_scorer(model_dir, config["files"][SCORER_FILE]), cfg.model
    from torchrec_cloud.serving.runtime import load_scorer as load_any

    return load_any(model_dir, "pt2", config=config), cfg.model


def _score(scorer: Any, model: Any, dataset: str, rows: int) -> tuple[Any, Any, float]:
    """Logits and labels of ``dataset``'s test split (a schema's dataset, whose features and
    tables must be the model's) by ``scorer``."""
    from torchrec_cloud.data.dataset import is_schema_dataset, load_dataset, read_manifest
    from torchrec_cloud.data.reader import SchemaSource
    from torchrec_cloud.serving.predict import score

    try:
        manifest = read_manifest(dataset)
        if not is_schema_dataset(manifest):
            raise ServingError(f"--gate {dataset}: not a dataset made from a schema (data preprocess --schema)")
        ds = load_dataset(dataset, manifest)
    except (ValueError, UntrustedInputError) as e:
        raise ServingError(f"--gate: {str(e).split(': ', 1)[-1]}") from None
    if ds.table_sizes != model.table_sizes or [f.name for f in ds.schema.sparse] != model.sparse_names:
        raise ServingError(f"--gate {dataset} does not fit the model: its features or tables differ")
    try:
        source = SchemaSource(ds, batch_size=4096, rank=0, world_size=1, splits=("test",))
    except ValueError as e:
        raise ServingError(f"--gate {dataset}: {str(e).split(': ', 1)[-1]}") from None
    (logits,), labels, seconds = score([scorer], source.eval_batches("test"), rows, progress=False)
    return logits, labels, seconds


class GateError(ServingError):
    """The new model scored lower than the one serving, by more than the tolerance (exit 1)."""


def publish(
    checkpoint: str,
    root: str,
    quantize: str = "none",
    dataset_path: Optional[str] = None,
    eval_rows: int = 1_000_000,
    log=print,
    formats=None,
    gate: Optional[str] = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, Any]:
    """Export ``checkpoint`` as a new version under ``root`` and make it ``current``;
    returns its model_config (``lineage.version`` names the folder). ``gate``: a dataset whose
    test split the new model must score within ``tolerance`` of the current one's AUC."""
    info = find_checkpoint(checkpoint)  # once: a checkpoint committed meanwhile is not mixed in
    cfg = job_config(info)
    parent = read_current(root)
    # A gated publish promotes a checkpoint: one that already serves has nothing to add (a plain
    # publish of it writes a new version, with other --quantize or --format, say).
    done = _published_before(root, parent, info, log) if gate else None
    if done is not None:
        return done
    checked = check_gate(info, cfg, root, parent, gate, tolerance, quantize, eval_rows, log) if gate else None
    version = version_name(info.step)
    lineage = {
        "version": version,
        "parent": parent,
        "checkpoint": {"path": info.path, "step": info.step},
        "dataset": dataset_lineage(dataset_path or cfg.data.dataset_path),
        **({"gate": checked} if checked is not None else {}),
    }
    final = storage.join(root, version)
    local = not storage.is_url(root)
    target = storage.join(root, TEMP_PREFIX + version) if local else final
    storage.makedirs(root)
    try:
        said = (lambda line: log(line.replace(target, final))) if local else log  # the name it will have
        config = export(info.path, target, quantize, dataset_path, eval_rows, said, formats, lineage)
        if local:
            os.rename(target, final)
    except BaseException:
        if local:
            storage.remove(target, recursive=True)  # never left looking like a version
        raise
    # write_bytes replaces a local file by a rename; an object is visible once uploaded whole.
    storage.write_bytes(storage.join(root, CURRENT_FILE), f"{version}\n".encode())
    log(f"published {final} (parent {parent or 'none'}); {storage.join(root, CURRENT_FILE)} names it")
    return config


