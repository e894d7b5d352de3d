"""``torchrec-cloud predict MODEL_DIR --input FILE --output F.csv``: score raw rows, or a
preprocessed dataset, with an exported model, one click probability per row::

    torchrec-cloud predict models/ev --input new_events.parquet --output scores.csv --json
    torchrec-cloud predict models/q --dataset_path /data/criteo --split val --output val.csv
    torchrec-cloud predict s3://bucket/models/q --dataset_path s3://bucket/criteo --split test --output test.csv --json

``--input`` is one raw file: Parquet or CSV/TSV of a model trained on a schema's dataset,
converted by the same transforms preprocessing applied (the schema, vocabularies and dense
statistics that ``export`` put in the model folder, checked against the digest export
recorded; an id never seen in training goes to its table's out-of-vocabulary row), or a raw Criteo TSV (plain or ``.gz``) for a Criteo model,
through preprocessing's parser with the model's table sizes. Either way its rows are exactly
what training read from shards made of it, so the AUC equals that evaluation's.
``--dataset_path`` scores a split of preprocessed shards (a raw Criteo file there works too,
as before). Rows are read as training's evaluation reads them and scored with the exported
TorchScript module, as a server would load it, so on the validation split the AUC and log
loss are the training run's final validation figures. The last line printed carries them
(``--json``: one JSON object with ``rows``, and ``auc``, ``logloss`` when the rows have the
label); the CSV has ``probability,label`` per row (``probability`` alone without labels).
A raw row that does not convert (text in a numeric column, a value not finite after its
transform, a row over preprocessing's caps) stops with ``FILE:LINE`` and the column, or with
``--on_bad_line skip`` is left out of the CSV and counted (``skipped_rows``). A metric that
has no value (the AUC of rows of one class) is ``null`` in the JSON, never ``NaN``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from torchrec_cloud import storage
from torchrec_cloud.config import ConfigError, JobConfig
from torchrec_cloud.errors import CommandError
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
def eval_source(cfg: JobConfig, batch_size: int, split: str = "val", pinned: Optional[dict[str, str]] = None,
                owner: str = "the model"):  # fmt: skip
    """A one-process reader of ``cfg``'s held-out data: its ``--dataset_path`` shards, or,
    without one, its synthetic data (the same rows training evaluated on). Only ``split``
    (``all``: every split) must have rows. A dataset's transforms must be those ``owner`` was
    trained with, ``pinned`` (:func:`~torchrec_cloud.serving.check_pinned`)."""
    from torchrec_cloud.serving import check_pinned

    cfg.data.batch_size = batch_size
    if cfg.data.dataset_path is None:
        from torchrec_cloud.data.synthetic import SyntheticSource

        return SyntheticSource(cfg, 0, 1)
    from torchrec_cloud.data.criteo_format import load_manifest
    from torchrec_cloud.data.criteo_reader import CriteoTSV
    from torchrec_cloud.data.dataset import is_schema_dataset, load_dataset, read_manifest
    from torchrec_cloud.data.reader import SchemaSource, build_criteo_source

    needed = ("train", "val", "test") if split == "all" else (split,)
    hint = "score the data it trained on, or data made with the same transforms"
    if is_file(cfg.data.dataset_path):
        check_pinned(pinned, cfg.data.dataset_path, None, cfg.model.table_sizes, owner, hint)
        return CriteoTSV(cfg.data.dataset_path, batch_size=batch_size, table_sizes=cfg.model.table_sizes,
                         dense_transform=cfg.data.dense_transform, multi_hot_sizes=cfg.data.multi_hot_sizes,
                         multi_hot_pooling=cfg.data.multi_hot_pooling, seed=cfg.data.seed)  # fmt: skip

    try:
        manifest = read_manifest(cfg.data.dataset_path)
        check_pinned(pinned, cfg.data.dataset_path, manifest, cfg.model.table_sizes, owner, hint)
        if is_schema_dataset(manifest):
            ds = load_dataset(cfg.data.dataset_path, manifest)
            if ds.table_sizes != cfg.model.table_sizes or [f.name for f in ds.schema.sparse] != cfg.model.sparse_names:
                raise ServingError(f"{cfg.data.dataset_path} does not fit the model: its features or tables differ")
            return SchemaSource(ds, batch_size=batch_size, rank=0, world_size=1, splits=needed)
        load_manifest(cfg.data.dataset_path)
    except ConfigError as e:
        raise ServingError(str(e).split(": ", 1)[-1]) from None
    try:
        return build_criteo_source(cfg, 0, 1, splits=needed)
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

    if split == "file":  # a raw file, scored whole
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
    from torchrec_cloud.progress import Progress

    start = time.perf_counter()
    parts: list[list[torch.Tensor]] = [[] for _ in modules]
    labels, rows = [], 0
    limit = total if max_rows is None or total is None else min(total, max_rows)
    bar = Progress("predict", "rows", total=limit, enabled=progress)
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
    dataset_path: Optional[str],
    split: str,
    output: str,
    batch_size: int = 4096,
    progress: bool = True,
    input: Optional[str] = None,  # noqa: A002 - the flag's name
    on_bad_line: str = "error",
) -> dict[str, Any]:
    """Score ``split`` of ``dataset_path``, or the raw file ``input``, with the model in
    ``model_dir``; write one probability per row to ``output`` (CSV: ``probability,label``, or
    ``probability`` for rows without labels) and return the metrics."""
    from torchrec_cloud.data.criteo_reader import CriteoTSV
    from torchrec_cloud.evaluation import binary_metrics

    if split not in SPLITS:
        raise ConfigError("split", f"expected one of {', '.join(SPLITS)}, got {split!r}")
    from torchrec_cloud.data.dataset import PINNED, pinned_of

    config = read_model_config(model_dir)
    where = storage.join(model_dir, CONFIG_FILE)
    cfg = saved_job_config(config, where)
    pinned = pinned_of(config.get(PINNED), where)
    if SCORER_FILE in config["files"]:
        scorer = load_scorer(model_dir, config["files"][SCORER_FILE])
    else:  # exported with --format pt2 alone
        from torchrec_cloud.serving.runtime import load_scorer as load_any

        scorer = load_any(model_dir, "pt2", config=config)
    labelled = True
    if input is not None and "transforms" in config:
        source = RawRows(config, model_dir, input, batch_size, cfg, pinned, on_bad_line)
        labelled, split = source.labelled, "file"
    else:
        if on_bad_line != "error":
            raise ConfigError("on_bad_line", "applies to Parquet or CSV rows of a model trained on a schema's dataset")
        cfg.data.dataset_path = input if input is not None else dataset_path
        source = eval_source(cfg, batch_size, split, pinned, f"the model in {model_dir}")
    if isinstance(source, CriteoTSV):
        split = "file"
    (logits,), labels, seconds = score([scorer], split_batches(source, split), None, progress, split_rows(source, split))
    probabilities = torch.sigmoid(logits.double())
    text = io.BytesIO()
    if labelled:
        table = np.column_stack([probabilities.numpy(), labels.numpy()])
        np.savetxt(text, table, fmt=["%.7g", "%d"], delimiter=",", header="probability,label", comments="")
    else:
        np.savetxt(text, probabilities.numpy()[:, None], fmt=["%.7g"], delimiter=",", header="probability", comments="")
    storage.write_bytes(output, text.getvalue())
    rows = int(logits.numel())
    result: dict[str, Any] = {"split": split, "rows": rows}
    if labelled:
        metrics = binary_metrics(logits, labels)
        result.update(auc=metrics["auc"], logloss=metrics["logloss"], ne=metrics["ne"])
    if isinstance(source, RawRows):
        result.update(skipped_rows=source.skipped, skipped_examples=source.examples)
    result.update(seconds=seconds, rows_per_s=rows / max(seconds, 1e-9), output=output,
                  quantize=config.get("quantize", "none"))  # fmt: skip
    return finite(result)


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite (an AUC of one class, a NaN loss) as None,
    so that its JSON is JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class RawRows:
    """A raw Parquet or CSV file read as one held-out split of a model trained on a schema's
    dataset: the model folder's transforms (``export`` wrote them), then the batches training
    read (:func:`~torchrec_cloud.data.reader.batch_of`). A row that does not convert stops
    with FILE:LINE and the column; rows without the label column are scored unlabelled."""

    def __init__(self, config: dict[str, Any], model_dir: str, path: str, batch_size: int, cfg: JobConfig,
                 pinned: Optional[dict[str, str]], on_bad_line: str = "error") -> None:  # fmt: skip
        from torchrec_cloud.data.dataset import PINNED, check_transforms, read_vocabularies, short, transforms_digest
        from torchrec_cloud.data.schema import parse_schema
        from torchrec_cloud.data.tabular import Input
        from torchrec_cloud.data.transforms import Transforms

        where = storage.join(model_dir, CONFIG_FILE)
        schema = parse_schema(config.get("schema"), f"{where} (schema)")
        spec = check_transforms(config.get("transforms"), schema, where, "transforms")
        if len(schema.dense) != cfg.model.num_dense_features or [f.name for f in schema.sparse] != cfg.model.sparse_names:
            raise UntrustedInputError(where, "schema", f"its {len(schema.dense)} dense and {len(schema.sparse)} sparse features "
                                      f"differ from the model's {cfg.model.num_dense_features} dense and "
                                      f"{len(cfg.model.sparse_names)} sparse ones: export again")  # fmt: skip
        if spec["table_sizes"] != cfg.model.table_sizes:
            raise UntrustedInputError(where, "transforms.table_sizes",
                                      f"{spec['table_sizes']} differ from the model's tables {cfg.model.table_sizes}")  # fmt: skip
        # The transforms loaded are those export pinned (the training dataset's): a folder
        # whose schema, statistics or vocabularies were replaced since scores nothing.
        digest = transforms_digest(schema, config["transforms"])
        if pinned is None or pinned["digest"] != digest:
            recorded = f"digest {short(pinned['digest'])}" if pinned is not None else f"no {PINNED}"
            raise ServingError(f"{where}: its transforms have digest {short(digest)}, the model was trained with "
                               f"{recorded} (altered since export): export the checkpoint again")  # fmt: skip
        self.transforms = Transforms(schema, read_vocabularies(model_dir, spec["vocab"], where), spec["dense_stats"],
                                     spec["boundaries"])  # fmt: skip
        self.path, self.batch_size, self.on_bad_line = path, batch_size, on_bad_line
        self.skipped, self.examples = 0, []
        probe = Input(path, schema, columns=[])
        self.labelled = schema.label.column in probe.available()
        self.input = Input(path, schema, columns=schema.columns_read(None, self.labelled))
        self.keys = [f.name for f in schema.sparse]
        self.singles = [k for k, f in enumerate(schema.sparse) if not f.list]
        self.lists = [k for k, f in enumerate(schema.sparse) if f.list]
        self.table_sizes = np.asarray(spec["table_sizes"], np.int64)

    def _bad(self, line: int, reason: str) -> None:
        from torchrec_cloud.data.tabular import BadRowError

        if self.on_bad_line == "error":
            raise BadRowError(self.path, line, reason)
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{self.path}:{line}: {reason}")

    def eval_batches(self, split: str = "file") -> Iterator[tuple[Any, int]]:
        from torchrec_cloud.data.dataset import Rows
        from torchrec_cloud.data.reader import batch_of

        t, bs = self.transforms, self.batch_size
        seen = 0  # rows the reader left out (wrong field count, over a cap) already handled
        try:
            for first, table in self.input.batches():
                enc = t.encode(table, None, labelled=self.labelled)
                bad = [(int(self.input.where(first + row).rsplit(":", 1)[1]), reason) for row, reason in enc.bad.items()]
                last = int(self.input.where(first + table.num_rows - 1).rsplit(":", 1)[1]) if table.num_rows else 0
                while seen < len(self.input.bad_lines) and self.input.bad_lines[seen][0] <= last:
                    bad.append(self.input.bad_lines[seen])
                    seen += 1
                for line, reason in sorted(bad):
                    self._bad(line, reason)
                self.skipped += enc.bad_count - len(enc.bad)  # beyond the first few, counted only
                rows = Rows(enc.records, enc.lists)
                for lo in range(0, len(rows), bs):
                    part = rows.slice(lo, min(lo + bs, len(rows)))
                    yield batch_of(part, self.keys, self.singles, self.lists, self.table_sizes, self.path), len(part)
            for line, reason in self.input.bad_lines[seen:]:
                self._bad(line, reason)
        except TypeError as e:  # a Parquet column of a type the schema cannot read
            raise ServingError(f"{self.path}: {e} (the file and the model's schema disagree)") from None
        except ValueError as e:
            if isinstance(e, CommandError):
                raise
            raise ServingError(f"{self.path}: {e}") from None


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "score a dataset with an exported model: one click probability per row, AUC and log loss"
    parser = add_command(subparsers, "predict", summary, __doc__, _main)
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a model directory written by `torchrec-cloud export`")
    parser.add_argument("--input", default=None, metavar="FILE",
                        help="one raw file to score: Parquet or CSV (a model of a schema's data), or Criteo TSV")  # fmt: skip
    parser.add_argument("--dataset_path", default=None,
                        help="preprocessed shards (a folder or s3://, gs://, az:// URL), or one raw Criteo TSV file")  # fmt: skip
    parser.add_argument("--split", choices=SPLITS, default="val", help="rows to score (all: train, val and test)")
    parser.add_argument("--output", required=True, metavar="FILE", help="CSV to write: probability,label per row")
    parser.add_argument("--batch_size", type=int, default=4096, help="rows scored at a time")
    parser.add_argument("--on_bad_line", choices=["error", "skip"], default="error",
                        help="--input: error: stop at the first row that does not convert, with FILE:LINE (exit 1); "
                             "skip: leave such rows out of the CSV and count them")  # fmt: skip
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def _main(ns: argparse.Namespace) -> int:
    if ns.batch_size <= 0:
        raise ConfigError("batch_size", f"must be > 0, got {ns.batch_size}")
    if (ns.input is None) == (ns.dataset_path is None):
        raise ConfigError("input", "give --input FILE (raw rows) or --dataset_path (preprocessed shards), one of them")
    result = predict(ns.model_dir, ns.dataset_path, ns.split, ns.output, ns.batch_size, not ns.no_progress, ns.input,
                     ns.on_bad_line)  # fmt: skip
    if ns.json:
        print(json.dumps(result, allow_nan=False))
    else:
        print(
            f"{result['split']}: {result['rows']} rows scored in {result['seconds']:.2f}s "
            f"({result['rows_per_s']:.0f} rows/s) -> {result['output']}"
        )
        if "auc" in result:
            print("  ".join(f"{k} {result[k]:.6f}" if result[k] is not None else f"{k} n/a" for k in ("auc", "logloss", "ne"))
                  + f"  rows {result['rows']}")
        else:
            print(f"rows {result['rows']} (no label column: probabilities only)")
        if result.get("skipped_rows"):
            print(f"skipped {result['skipped_rows']} bad rows (not in {result['output']}); first ones:")
            for example in result["skipped_examples"]:
                print(f"  {example}")
    return 0
