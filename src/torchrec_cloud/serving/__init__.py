"""After training: a checkpoint exported to a model directory that serves, and files scored with it.

- ``export``: ``torchrec-cloud export CHECKPOINT --output DIR [--quantize none|fp16|int8]``
  gathers a sharded checkpoint of any world size on one process and writes the model
  directory below;
- ``predict``: ``torchrec-cloud predict DIR --dataset_path D --split val --output F.csv``
  scores preprocessed shards with the exported module, and reports AUC and log loss when
  the rows have labels;
- ``scorer``: the plain-torch scoring module that ``export`` compiles with TorchScript and
  with torch.export + AOTInductor;
- ``runtime``: ``load_scorer(model_dir, runtime="auto"|"pt2"|"torchscript")``, what a
  server and ``predict`` score with;
- ``publish``: ``export CHECKPOINT --publish ROOT``, versions of a model under one root and
  its ``current`` file, which ``serve ROOT`` follows.

A model directory (a local folder or a bucket URL)::

    scorer.pt           TorchScript: (dense [B, 13] float, ids [B, 26] int64) -> probabilities [B]
    scorer.pt2          torch.export program compiled by AOTInductor for CPU (scorer.cuda.pt2:
                        for CUDA, when exported on a GPU): (dense, values, lengths) -> logits [B]
    weights.pt          the unsharded float32 state dict of TorchRec's DLRMTrain
                        (torch.save; load with torch.load(..., weights_only=True))
    tables.pt           the scorer's tables as it holds them, which ``serve`` memory-maps
    vocab/NAME.json     a schema's dataset only: the vocabularies scoring raw rows needs
    model_config.json   written last: format, model config, feature spec, source checkpoint,
                        quantization and what it costs in AUC; for a schema's dataset its
                        schema and transforms (table sizes, vocabulary files, dense statistics);
                        the digest of the transforms it trained with (``pinned_transforms``)

See docs/serving.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable, Optional, Sequence

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, DataConfig, JobConfig, ModelConfig
from torchrec_cloud.errors import CommandError
from torchrec_cloud.untrusted import MAX_FILE_BYTES, Fields, UntrustedInputError, integer, read_json, shown, text

MODEL_FORMAT = "torchrec-cloud-model"
MODEL_VERSION = 1
CONFIG_FILE = "model_config.json"
SCORER_FILE = "scorer.pt"
WEIGHTS_FILE = "weights.pt"
TABLES_FILE = "tables.pt"
"""The scoring module's tables as it holds them (``tables.weight``, ``tables.scale``,
``tables.bias`` of :class:`~torchrec_cloud.serving.scorer.Tables`, quantized as the scorer is):
``serve`` maps this file (``torch.load(..., mmap=True)``) in place of the scorer's own copy, so
worker processes share one copy of the tables in the page cache."""
PT2_FILES = {"cpu": "scorer.pt2", "cuda": "scorer.cuda.pt2"}
"""The AOTInductor packages ``export --format pt2`` writes, by the device they were compiled
for (a CUDA one only when exported on a GPU); ``model_config.json``'s ``pt2`` says with which torch."""


def write_line(line: str) -> None:
    """One line on stderr in one write: ``serve --workers N``'s processes share the file (and
    unbuffered, ``PYTHONUNBUFFERED``, ``print`` writes the text and its newline apart, so two
    processes' lines could merge)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class ServingError(CommandError, RuntimeError):
    """A checkpoint, model directory or dataset that export or predict cannot use."""


CONFIG_MAX_BYTES = 16 << 20


def read_model_config(model_dir: str) -> dict[str, Any]:
    """The ``model_config.json`` of an exported model, checked to be one this version reads,
    field by field (:func:`check_model_config`)."""
    path = storage.join(model_dir, CONFIG_FILE)
    try:
        config = read_json(path, CONFIG_MAX_BYTES)
    except storage.StorageNotFoundError:
        raise ServingError(f"{path} not found: not a model directory (make one with `torchrec-cloud export`)") from None
    except UntrustedInputError as e:
        raise ServingError(str(e)) from None
    if not isinstance(config, dict) or config.get("format") != MODEL_FORMAT:
        raise ServingError(f"{path} is not a {MODEL_FORMAT} config")
    if config.get("version") != MODEL_VERSION:
        raise ServingError(
            f"{path} is a {MODEL_FORMAT} v{shown(config.get('version'))}; this torchrec-cloud reads "
            f"v{MODEL_VERSION}: export the checkpoint again with this version"
        )
    try:
        return check_model_config(config, path)
    except UntrustedInputError as e:
        raise ServingError(str(e)) from None


def check_model_config(config: dict[str, Any], path: str) -> dict[str, Any]:
    """``config`` if the fields predict reads have the types and ranges ``export`` writes: the
    model's sizes, the data transform, the quantization, and the files with their sizes (the
    scorer is read no further than its recorded size); an UntrustedInputError otherwise."""
    doc = Fields(config, path)
    model = doc.obj("model")
    model.text("interaction", choices=("dot", "dcn", "projection"))
    for key in ("num_dense_features", "num_sparse_features", "embedding_dim", "dcn_num_layers", "dcn_low_rank_dim"):
        model.int(key, lo=1, hi=1 << 20, optional=key.startswith("dcn"))
    model.int("num_embeddings", lo=1)
    model.ints("num_embeddings_per_feature", 1 << 20, lo=1, optional=True)
    for i, name in enumerate(model.list("feature_names", 1 << 20, optional=True) or []):
        text(name, path, f"model.feature_names[{i}]", max_len=64)
    for i, pooling in enumerate(model.list("pooling", 1 << 20, optional=True) or []):
        text(pooling, path, f"model.pooling[{i}]", choices=("sum", "mean"))
    for key in ("dense_arch_layer_sizes", "over_arch_layer_sizes", "interaction_branch1_layer_sizes",
                "interaction_branch2_layer_sizes"):  # fmt: skip
        model.ints(key, 64, lo=1, hi=1 << 20, optional=key.startswith("interaction"))
    data = doc.obj("data", optional=True)
    if data is not None:
        data.text("dense_transform", choices=("torchrec", "log1p"), optional=True)
        data.ints("multi_hot_sizes", 1 << 20, lo=1, hi=1 << 16, optional=True)
        data.text("multi_hot_pooling", choices=("fixed", "random"), optional=True)
        data.int("seed", hi=2**64, optional=True)
    from torchrec_cloud.serving.scorer import QUANTIZE

    doc.text("quantize", choices=QUANTIZE)
    for name, size in doc.mapping("files", 3 + len(PT2_FILES)).items():
        text(name, path, "files", choices=(SCORER_FILE, WEIGHTS_FILE, TABLES_FILE, *PT2_FILES.values()))
        integer(size, path, f"files.{name}", hi=MAX_FILE_BYTES)
    if not any(name in config["files"] for name in (SCORER_FILE, *PT2_FILES.values())):
        raise UntrustedInputError(path, "files", f"lists no scorer ({SCORER_FILE} or {PT2_FILES['cpu']})")
    pt2 = doc.obj("pt2", optional=True)
    if pt2 is not None:
        pt2.text("torch", max_len=64)
    return config


def _section(cls: type, saved: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in saved.items() if k in names})


def saved_job_config(saved: dict[str, Any], where: str) -> JobConfig:
    """The model and data sections of a saved config (a checkpoint's commit, a model's
    config) as a JobConfig; fields this version does not know are dropped."""
    if not isinstance(saved.get("model"), dict):
        raise ServingError(f"{where} has no model config (written by an older torchrec-cloud)")
    try:
        return JobConfig(model=_section(ModelConfig, saved["model"]), data=_section(DataConfig, saved.get("data") or {}))
    except (ConfigError, TypeError) as e:
        raise ServingError(f"{where}: the saved model config is unusable ({e})") from None


def check_pinned(pinned: Optional[dict[str, str]], path: str, manifest: Any, table_sizes: Sequence[int],
                 owner: str, hint: str) -> dict[str, str]:  # fmt: skip
    """The transforms of the data at ``path`` are those ``owner`` (a checkpoint, a model) was
    trained with, ``pinned`` (:data:`~torchrec_cloud.data.dataset.PINNED`): returns the data's
    own record, else a ServingError naming both digests, and ``hint``. ``manifest`` is its
    manifest as read (None: a raw Criteo TSV, read with the model's table sizes).

    A path recorded in a checkpoint is untrusted, and a folder may have been rebuilt since:
    only this digest decides which dataset's transforms reach a model. A schema's dataset needs
    a pinned digest equal to its own; Criteo data one pinned by a Criteo run, or none (a model
    of synthetic data scores Criteo rows as before: its table sizes are checked where the rows
    are read)."""
    from torchrec_cloud.data.dataset import criteo_digest, is_schema_dataset, load_dataset, short

    if is_schema_dataset(manifest):
        try:
            found = {"kind": "schema", "digest": load_dataset(path, manifest, check_files=False).digest}
        except UntrustedInputError as e:
            raise ServingError(str(e)) from None
    else:
        found = {"kind": "criteo", "digest": criteo_digest(table_sizes)}
    if pinned is None and found["kind"] == "criteo":
        return found
    if pinned is not None and found["digest"] == pinned["digest"]:
        return found
    kind = "Criteo" if found["kind"] == "criteo" else "the"
    theirs = f"{shown(path, 200)} has {kind} transforms of digest {short(found['digest'])}"
    if pinned is None:
        raise ServingError(f"{theirs}; {owner} records no transforms it was trained with (synthetic data, a "
                           "--data_source, or saved before transforms were pinned), so no dataset's can be checked "
                           "against it: train on this dataset to score its rows")  # fmt: skip
    raise ServingError(f"{theirs}; {owner} was trained with digest {short(pinned['digest'])}: not the data it trained "
                       f"on (another dataset, or one rebuilt since); {hint}")  # fmt: skip


def add_command(
    subparsers: argparse._SubParsersAction, name: str, summary: str, doc: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """The parser of ``torchrec-cloud NAME``, running ``run``. A checkpoint, model or dataset it
    cannot use raises a ServingError (a CommandError): ``cli.main`` prints it as one line, exit 1
    (a bad flag: ConfigError, exit 2)."""

    def main(ns: argparse.Namespace) -> int:
        from torchrec_cloud.progress import quiet_library_warnings

        quiet_library_warnings()  # torch.fx's is_fx_tracing notice, TorchRec's internals: nothing to act on
        return run(ns)

    parser = subparsers.add_parser(name, help=summary, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(func=main)
    return parser
