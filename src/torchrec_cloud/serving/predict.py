"""``torchrec-cloud predict MODEL_DIR --dataset_path D --output F.csv``: score a dataset with an
exported model, one click probability per row::

    torchrec-cloud predict models/q --dataset_path /data/criteo --split val --output val.csv
    torchrec-cloud predict s3://bucket/models/q --dataset_path s3://bucket/criteo --split test --output test.csv --json

The dataset is a folder or URL of preprocessed shards (``torchrec-cloud data preprocess``),
or one raw Criteo TSV file (plain or ``.gz``), scored whole through preprocessing's parser
with the model's table sizes, so its rows are exactly what training read from shards made
of it (``--split`` then does not apply).
Rows are read as training's evaluation reads them and scored with the exported TorchScript
module, as a server would load it, so on the validation split the AUC and log loss are
the training run's final validation figures. The last line printed carries them
(``--json``: one JSON object with ``rows``, ``auc``, ``logloss``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.untrusted import UntrustedInputError, read_capped
from torchrec_cloud.serving import (
    CONFIG_FILE,
    SCORER_FILE,
    ServingError,
    add_command,
    read_model_config,
    saved_job_config,
)

SPLITS = ("val", "test", "all")


def eval_source(cfg: JobConfig, batch_size: int, split: str = "val"):
    """A one-process reader of ``cfg``'s held-out data: its ``--dataset_path`` shards, or,
    without one, its synthetic data (the same rows training evaluated on). Only ``split``
    (``all``: every split) must have rows."""
    cfg.data.batch_size = batch_size
    if cfg.data.dataset_path is None:
        from torchrec_cloud.data.synthetic import SyntheticSource

        return SyntheticSource(cfg, 0, 1)
    from torchrec_cloud.data.criteo_reader import CriteoTSV, build_criteo_source, load_manifest

    if is_file(cfg.data.dataset_path):
        return CriteoTSV(cfg.data.dataset_path, batch_size=batch_size, table_sizes=cfg.model.table_sizes,
                         dense_transform=cfg.data.dense_transform, multi_hot_sizes=cfg.data.multi_hot_sizes,
                         multi_hot_pooling=cfg.data.multi_hot_pooling, seed=cfg.data.seed)  # fmt: skip

    try:
        load_manifest(cfg.data.dataset_path)
    except ConfigError as e:
        raise ServingError(str(e).split(": ", 1)[-1]) from None
    try:
        return build_criteo_source(cfg, 0, 1, splits=("train", "val", "test") if split == "all" else (split,))
    except ConfigError as e:
        if e.flag == "batch_size":
            raise
        raise ServingError(f"{cfg.data.dataset_path} does not fit the model: {str(e).split(': ', 1)[-1]}") from None


def is_file(path: str) -> bool:
    """``path`` names one file (a raw TSV), not a folder of shards."""
    try:
        fs, inner = storage.filesystem(path)
        return bool(fs.isfile(inner))
    except Exception:  # noqa: BLE001 - unreachable or missing: the shards' reader says which
        return False


def split_batches(source, split: str) -> Iterator[tuple[Any, int]]:
    """``(batch, valid_rows)`` of ``split``; ``all`` is every split the source has, in order."""
    from torchrec_cloud.data.criteo_parse import PreprocessError

    if split == "file":  # a raw TSV, scored whole
        try:
            yield from source.eval_batches()
        except PreprocessError as e:
            raise ServingError(str(e)) from None
        return
    names = [s for s in ("train", "val", "test") if s in getattr(source, "splits", ("val", "test"))]
    for name in names if split == "all" else [split]:
        yield from source.eval_batches(name)


def split_rows(source, split: str) -> Optional[int]:
    splits = getattr(source, "splits", None)
    if splits is None:
        return None
    return sum(s.rows for name, s in splits.items() if split in ("all", name))


@torch.no_grad()
def score(
    modules: Sequence[torch.jit.ScriptModule],
    batches: Iterator[tuple[Any, int]],
    max_rows: Optional[int] = None,
    progress: bool = True,
    total: Optional[int] = None,
) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    """Logits of every module over ``batches`` (``max_rows`` at most), the labels, seconds."""
    from tqdm import tqdm

    start = time.perf_counter()
    parts: list[list[torch.Tensor]] = [[] for _ in modules]
    labels, rows = [], 0
    limit = total if max_rows is None or total is None else min(total, max_rows)
    bar = tqdm(total=limit, unit="rows", unit_scale=True, file=sys.stderr, disable=not progress, leave=False)
    try:
        for batch, valid in batches:
            if max_rows is not None:
                valid = min(valid, max_rows - rows)
            if valid > 0:
                kjt = batch.sparse_features
                for out, module in zip(parts, modules):
                    logits = module.logits_of_bags(batch.dense_features, kjt.values(), kjt.lengths())
                    out.append(logits[:valid])
                labels.append(batch.labels.view(-1)[:valid].float())
                rows += valid
                bar.update(valid)
            if max_rows is not None and rows >= max_rows:
                break
    finally:
        bar.close()
    if not labels:
        raise ServingError("the split has no rows")
    return [torch.cat(p) for p in parts], torch.cat(labels), time.perf_counter() - start


def load_scorer(model_dir: str, size: int) -> torch.jit.ScriptModule:
    """The model folder's TorchScript scorer, read no further than the ``size`` its
    model_config.json records (the folder must be trusted: a TorchScript file is code)."""
    path = storage.join(model_dir, SCORER_FILE)
    try:
        data = read_capped(path, size)
    except UntrustedInputError as e:
        raise ServingError(f"{e}; its {CONFIG_FILE} says {size} bytes: export again") from None
    if len(data) != size:
        raise ServingError(f"{path} has {len(data)} bytes; its {CONFIG_FILE} says {size}: export again")
    try:
        return torch.jit.load(io.BytesIO(data), map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged archive fails in many ways
        raise ServingError(f"{path} is not a loadable TorchScript module ({type(e).__name__})") from None


def predict(
    model_dir: str,
    dataset_path: str,
    split: str,
    output: str,
    batch_size: int = 4096,
    progress: bool = True,
) -> dict[str, Any]:
    """Score ``split`` of ``dataset_path`` with the model in ``model_dir``, write one probability
    per row to ``output`` (CSV: ``probability,label``) and return the metrics."""
    from torchrec_cloud.data.criteo_reader import CriteoTSV
    from torchrec_cloud.evaluation import binary_metrics

    if split not in SPLITS:
        raise ConfigError("split", f"expected one of {', '.join(SPLITS)}, got {split!r}")
    config = read_model_config(model_dir)
    cfg = saved_job_config(config, storage.join(model_dir, CONFIG_FILE))
    cfg.data.dataset_path = dataset_path
    scorer = load_scorer(model_dir, config["files"][SCORER_FILE])
    source = eval_source(cfg, batch_size, split)
    if isinstance(source, CriteoTSV):
        split = "file"
    (logits,), labels, seconds = score([scorer], split_batches(source, split), None, progress, split_rows(source, split))
    probabilities = torch.sigmoid(logits.double())
    table = np.column_stack([probabilities.numpy(), labels.numpy()])
    text = io.BytesIO()
    np.savetxt(text, table, fmt=["%.7g", "%d"], delimiter=",", header="probability,label", comments="")
    storage.write_bytes(output, text.getvalue())
    metrics = binary_metrics(logits, labels)
    return {
        "split": split,
        "rows": metrics["rows"],
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
        "ne": metrics["ne"],
        "seconds": seconds,
        "rows_per_s": metrics["rows"] / max(seconds, 1e-9),
        "output": output,
        "quantize": config.get("quantize", "none"),
    }


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "score a dataset with an exported model: one click probability per row, AUC and log loss"
    parser = add_command(subparsers, "predict", summary, __doc__, _main)
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a model directory written by `torchrec-cloud export`")
    parser.add_argument("--dataset_path", required=True,
                        help="preprocessed shards (a folder or s3://, gs://, az:// URL), or one raw Criteo TSV file")  # fmt: skip
    parser.add_argument("--split", choices=SPLITS, default="val", help="rows to score (all: train, val and test)")
    parser.add_argument("--output", required=True, metavar="FILE", help="CSV to write: probability,label per row")
    parser.add_argument("--batch_size", type=int, default=4096, help="rows scored at a time")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def _main(ns: argparse.Namespace) -> int:
    if ns.batch_size <= 0:
        raise ConfigError("batch_size", f"must be > 0, got {ns.batch_size}")
    result = predict(ns.model_dir, ns.dataset_path, ns.split, ns.output, ns.batch_size, not ns.no_progress)
    if ns.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['split']}: {result['rows']} rows scored in {result['seconds']:.2f}s "
            f"({result['rows_per_s']:.0f} rows/s) -> {result['output']}"
        )
        print(f"auc {result['auc']:.6f}  logloss {result['logloss']:.6f}  ne {result['ne']:.6f}  rows {result['rows']}")
    return 0
