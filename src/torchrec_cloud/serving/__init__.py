"""After training: a checkpoint exported to a model directory that serves, and files scored with it.

- ``export``: ``torchrec-cloud export CHECKPOINT --output DIR [--quantize none|fp16|int8]``
  gathers a sharded checkpoint of any world size on one process and writes the model
  directory below;
- ``predict``: ``torchrec-cloud predict DIR --dataset_path D --split val --output F.csv``
  scores preprocessed shards with the exported module, and reports AUC and log loss when
  the rows have labels;
- ``scorer``: the plain-torch scoring module that ``export`` compiles with TorchScript.

A model directory (a local folder or a bucket URL)::

    scorer.pt           TorchScript: (dense [B, 13] float, ids [B, 26] int64) -> probabilities [B]
    weights.pt          the unsharded float32 state dict of TorchRec's DLRMTrain
                        (torch.save; load with torch.load(..., weights_only=True))
    model_config.json   written last: format, model config, feature spec, source checkpoint,
                        quantization and what it costs in AUC

See docs/serving.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, DataConfig, JobConfig, ModelConfig
from torchrec_cloud.errors import CommandError

MODEL_FORMAT = "torchrec-cloud-model"
MODEL_VERSION = 1
CONFIG_FILE = "model_config.json"
SCORER_FILE = "scorer.pt"
WEIGHTS_FILE = "weights.pt"


class ServingError(CommandError, RuntimeError):
    """A checkpoint, model directory or dataset that export or predict cannot use."""


def read_model_config(model_dir: str) -> dict[str, Any]:
    """The ``model_config.json`` of an exported model, checked to be one this version reads."""
    path = storage.join(model_dir, CONFIG_FILE)
    try:
        config = json.loads(storage.read_bytes(path))
    except storage.StorageNotFoundError:
        raise ServingError(f"{path} not found: not a model directory (make one with `torchrec-cloud export`)") from None
    except ValueError as e:
        raise ServingError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("format") != MODEL_FORMAT:
        raise ServingError(f"{path} is not a {MODEL_FORMAT} config")
    if config.get("version") != MODEL_VERSION:
        raise ServingError(
            f"{path} is a {MODEL_FORMAT} v{config.get('version')}; this torchrec-cloud reads "
            f"v{MODEL_VERSION}: export the checkpoint again with this version"
        )
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


def add_command(
    subparsers: argparse._SubParsersAction, name: str, summary: str, doc: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """The parser of ``torchrec-cloud NAME``, running ``run``. A checkpoint, model or dataset it
    cannot use raises a ServingError (a CommandError): ``cli.main`` prints it as one line, exit 1."""
    parser = subparsers.add_parser(name, help=summary, description=doc.split("\n\n")[0])
    parser.set_defaults(func=run)
    return parser
