"""``torchrec-cloud export CHECKPOINT --output DIR``: a sharded training checkpoint to a model
directory that serves (layout in :mod:`torchrec_cloud.serving`)::

    torchrec-cloud export runs/q/checkpoints --output models/q
    torchrec-cloud export s3://bucket/runs/q/checkpoints/step_00002000 --output s3://bucket/models/q --quantize int8

CHECKPOINT is one checkpoint, a folder of them (its newest complete one, as resume picks), or
a run folder (the ``--output_dir``: the checkpoints its run wrote), as ``checkpoint ls`` takes.
A checkpoint of any world size is read whole on this one process, without a process group:
DCP's index says where every shard of every table lives, so the tables are gathered from
the ranks' files as they were saved.

With ``--quantize fp16|int8`` the tables of the scoring module are quantized and the AUC
it costs is measured on the run's validation split (its own synthetic data, its
``--dataset_path``, or the one given here) and printed.

A model of a schema's dataset carries that dataset's transforms (schema, vocabularies, dense
statistics), taken only from a dataset whose transforms have the digest the checkpoint
recorded when it trained (``pinned_transforms`` in COMMIT.json): the folder COMMIT.json
names, or ``--dataset_path``, is checked, never trusted (docs/data.md, "Transforms pinned to
the model").
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
import time
from typing import Any, Optional

import torch

from torchrec_cloud import counted, storage
from torchrec_cloud.checkpoint.dcp import load_full_state, read_metadata
from torchrec_cloud.checkpoint.store import COMMIT_FILE, CheckpointDamagedError, CheckpointInfo, lease, resolve
from torchrec_cloud.config import ConfigError, JobConfig, ModelConfig
from torchrec_cloud.serving import (
    CONFIG_FILE,
    MODEL_FORMAT,
    MODEL_VERSION,
    SCORER_FILE,
    WEIGHTS_FILE,
    ServingError,
    add_command,
    saved_job_config,
)
from torchrec_cloud.serving.scorer import QUANTIZE, Scorer, Tables

MODEL_PREFIX = "model."  # the model's entries in a checkpoint (see checkpoint.dcp.training_state)


def find_checkpoint(path: str) -> CheckpointInfo:
    """``path`` itself when it is a complete checkpoint, else the newest complete one under
    it: what ``--resume_from PATH`` would resume."""
    try:
        return resolve(path)
    except ConfigError as e:
        raise ServingError(str(e).split(": ", 1)[-1]) from None


def job_config(info: CheckpointInfo) -> JobConfig:
    """The model and data config a checkpoint was trained with (from its COMMIT.json)."""
    return saved_job_config((info.commit or {}).get("config") or {}, f"{info.path}/{COMMIT_FILE}")


def pinned_transforms(info: CheckpointInfo) -> Optional[dict[str, str]]:
    """The transforms the checkpoint trained with, as its COMMIT.json records them (kind and
    digest, checked); None when it records none (synthetic data, a --data_source)."""
    from torchrec_cloud.data.dataset import PINNED, pinned_of
    from torchrec_cloud.untrusted import UntrustedInputError

    try:
        return pinned_of((info.commit or {}).get(PINNED), f"{info.path}/{COMMIT_FILE}")
    except UntrustedInputError as e:
        raise ServingError(str(e)) from None


def check_holds_model(info: CheckpointInfo, cfg: JobConfig) -> None:
    """The checkpoint's index (``.metadata``, checked against its files) holds every weight of
    the model its COMMIT.json describes, with the same shape: a ServingError otherwise, before
    anything is allocated (a COMMIT.json may describe any model; the index's tensors are
    bounded by the checkpoint's bytes). The model is built on the meta device to compare."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchrec_cloud.model import build_model

    try:
        index = read_metadata(info.path, info.commit).state_dict_metadata
    except CheckpointDamagedError as e:
        raise ServingError(f"cannot read checkpoint {info.path}: {e.file}: {e.detail}") from None
    saved = {k[len(MODEL_PREFIX) :]: tuple(md.size) for k, md in index.items()
             if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}  # fmt: skip
    tables = sum(".embedding_bags." in k for k in saved)
    if cfg.model.num_sparse_features != tables:
        raise ServingError(f"{info.path} does not hold the model its {COMMIT_FILE} describes "
                           f"({cfg.model.num_sparse_features} tables; it holds {tables})")  # fmt: skip
    with torch.device("meta"):
        expected = build_model(cfg.model, dense_device=torch.device("meta")).state_dict()
    missing = sorted(set(expected) - set(saved))
    wrong = [k for k in expected if k in saved and tuple(expected[k].shape) != saved[k]]
    if missing or wrong:
        what = f"missing {missing[0]}" if missing else f"{wrong[0]} has shape {saved[wrong[0]]}"
        raise ServingError(f"{info.path} does not hold the model its {COMMIT_FILE} describes ({what})")


def unsharded_model(info: CheckpointInfo, cfg: JobConfig) -> torch.nn.Module:
    """TorchRec's DLRMTrain on this process's CPU, with every table whole, from the checkpoint."""
    from torchrec_cloud.model import build_model

    check_holds_model(info, cfg)
    try:
        state = load_full_state(info.path)
    except (storage.StorageError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise ServingError(f"cannot read checkpoint {info.path}: {_first_line(e)}") from None
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
    model = build_model(cfg.model, dense_device=torch.device("cpu"))
    model.load_state_dict({k: weights[k] for k in model.state_dict()}, assign=True)
    return model.eval()


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (error, traceback)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def scorer_of(model: torch.nn.Module, quantize: str) -> torch.jit.ScriptModule:
    """The TorchScript scoring module of an unsharded DLRMTrain (see :mod:`.scorer`)."""
    dlrm = model.model
    ebc = dlrm.sparse_arch.embedding_bag_collection
    from torchrec.modules.embedding_configs import PoolingType

    configs = ebc.embedding_bag_configs()
    tables = [ebc.embedding_bags[c.name].weight for c in configs]
    mean = [c.pooling == PoolingType.MEAN for c in configs]
    scorer = Scorer(dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch, Tables(tables, quantize, mean))
    for p in scorer.parameters():
        p.requires_grad_(False)  # a server scores; no autograd graph per request
    return torch.jit.script(scorer.eval())


def check_against_torchrec(model: torch.nn.Module, scorer: torch.jit.ScriptModule, cfg: ModelConfig) -> None:
    """The exported module must give TorchRec's logits on a random batch of bags of 0 to 3 ids:
    a wrong mapping of any weight (or pooling) fails the export here rather than serving wrong
    scores."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(0)
    b = 64
    dense = torch.rand(b, cfg.num_dense_features, generator=g)
    lengths = torch.randint(0, 4, (cfg.num_sparse_features * b,), generator=g, dtype=torch.int32)
    per_table = lengths.view(cfg.num_sparse_features, b).sum(dim=1).tolist()
    values = torch.cat([torch.randint(0, n, (int(k),), generator=g) for n, k in zip(cfg.table_sizes, per_table)])
    kjt = KeyedJaggedTensor(keys=cfg.sparse_names, values=values, lengths=lengths, stride=b)
    with torch.no_grad():
        expected = model.model(dense, kjt).view(-1)
        got = scorer.logits_of_bags(dense, values, lengths)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise ServingError(
            f"the exported module disagrees with TorchRec's model (max |diff| {float((got - expected).abs().max()):.3g})"
        )


def _module_bytes(module: torch.jit.ScriptModule) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return buffer.getvalue()


def quantization_cost(fp32: torch.jit.ScriptModule, quantized: torch.jit.ScriptModule, cfg: JobConfig, max_rows: int,
                      pinned: Optional[dict[str, str]] = None, owner: str = "the checkpoint") -> dict[str, Any]:  # fmt: skip
    """AUC and log loss of both modules on the run's validation split (``max_rows`` at most),
    of a dataset whose transforms are ``pinned``."""
    from torchrec_cloud.evaluation import binary_metrics
    from torchrec_cloud.serving.predict import eval_source, score

    source = eval_source(cfg, cfg.data.batch_size, pinned=pinned, owner=owner)
    logits, labels, seconds = score([fp32, quantized], source.eval_batches("val"), max_rows, progress=False)
    base, after = binary_metrics(logits[0], labels), binary_metrics(logits[1], labels)
    return {
        "split": "val",
        "rows": base["rows"],
        "auc_fp32": base["auc"],
        "auc": after["auc"],
        "auc_change": after["auc"] - base["auc"],
        "logloss_fp32": base["logloss"],
        "logloss": after["logloss"],
    }


def export(
    checkpoint: str,
    output: str,
    quantize: str = "none",
    dataset_path: Optional[str] = None,
    eval_rows: int = 1_000_000,
    log=print,
) -> dict[str, Any]:
    """Write the model directory of ``checkpoint`` to ``output``; returns its model_config."""
    if quantize not in QUANTIZE:
        raise ConfigError("quantize", f"expected one of {', '.join(QUANTIZE)}, got {quantize!r}")
    start = time.perf_counter()
    info = find_checkpoint(checkpoint)
    cfg = job_config(info)
    pinned = pinned_transforms(info)
    if dataset_path is not None:
        cfg.data.dataset_path = dataset_path
    # Before the weights are read: the transforms come only from a dataset whose digest is the
    # checkpoint's, whichever folder its COMMIT.json (untrusted) or --dataset_path names.
    transforms, vocab_files = dataset_transforms(cfg, pinned, f"checkpoint {info.path}", dataset_path is not None)
    with lease(info.path, "export") as held:  # a training job's retention leaves it alone meanwhile
        if not held:
            print(f"torchrec-cloud export: note: no read lease placed in {info.path} (not writable): a training "
                  "job's retention could delete it while it is read", file=sys.stderr)  # fmt: skip
        model = unsharded_model(info, cfg)
    fp32 = scorer_of(model, "none")
    check_against_torchrec(model, fp32, cfg.model)
    scorer = fp32 if quantize == "none" else scorer_of(model, quantize)
    scorer_bytes = _module_bytes(scorer)
    weights = io.BytesIO()
    torch.save({k: v.detach().contiguous() for k, v in model.state_dict().items()}, weights)

    config: dict[str, Any] = {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "model": dataclasses.asdict(cfg.model),
        "features": {
            "dense": cfg.model.num_dense_features,
            "sparse": cfg.model.sparse_names,
            "table_sizes": cfg.model.table_sizes,
            "embedding_dim": cfg.model.embedding_dim,
            "dense_transform": cfg.data.dense_transform,
            "multi_hot_sizes": cfg.data.multi_hot_sizes,
            "multi_hot_pooling": cfg.data.multi_hot_pooling,
        },
        "data": dataclasses.asdict(cfg.data),
        "checkpoint": {"path": info.path, "step": info.step, "world_size": info.world_size},
        "quantize": quantize,
        "files": {SCORER_FILE: len(scorer_bytes), WEIGHTS_FILE: len(weights.getvalue())},
        "scorer_bytes_fp32": len(_module_bytes(fp32)) if quantize != "none" else len(scorer_bytes),
        **transforms,
    }
    if quantize != "none":
        try:
            config["quantization"] = quantization_cost(fp32, scorer, cfg, eval_rows, pinned, f"checkpoint {info.path}")
        except (ConfigError, storage.StorageError) as e:
            config["quantization"] = {"not_measured": _first_line(e)}

    storage.makedirs(output)
    config_path = storage.join(output, CONFIG_FILE)
    if storage.exists(config_path):
        storage.remove(config_path)  # the folder is a model again only once all is rewritten
    storage.write_bytes(storage.join(output, SCORER_FILE), scorer_bytes)
    storage.write_bytes(storage.join(output, WEIGHTS_FILE), weights.getvalue())
    for path, data in vocab_files.items():
        storage.write_bytes(storage.join(output, *path.split("/")), data)
    storage.write_bytes(config_path, json.dumps(config, indent=1).encode())
    config["seconds"] = time.perf_counter() - start
    _report(config, output, log)
    return config


def dataset_transforms(cfg: JobConfig, pinned: Optional[dict[str, str]], owner: str,
                       given: bool) -> tuple[dict[str, Any], dict[str, bytes]]:  # fmt: skip
    """What scoring raw rows needs from the dataset the checkpoint trained on: the model
    config's ``schema``, ``transforms`` (table sizes, vocabulary files, dense statistics;
    hashing is by the schema's rule) and ``pinned_transforms``, and the vocabulary files'
    bytes, checked against the manifest. Only a dataset whose transforms have the digest the
    checkpoint ``pinned`` qualifies (``given``: its path came from --dataset_path, else from
    COMMIT.json). For Criteo data the pinned record alone (predict reads a raw Criteo TSV by
    its own rules, with the model's table sizes); nothing for synthetic data."""
    from torchrec_cloud.data.dataset import PINNED, is_schema_dataset, load_dataset, read_manifest, vocabulary_bytes
    from torchrec_cloud.serving import check_pinned
    from torchrec_cloud.untrusted import UntrustedInputError

    path = cfg.data.dataset_path
    if path is None:
        return {}, {}
    hint = ("export without --dataset_path (the dataset it trained on)" if given
            else f"its {COMMIT_FILE} names this folder: give the dataset it trained on with --dataset_path")  # fmt: skip
    try:
        manifest = read_manifest(path)
        found = check_pinned(pinned, path, manifest, cfg.model.table_sizes, owner, hint)
        if not is_schema_dataset(manifest):
            return ({PINNED: found} if pinned is not None else {}), {}
        ds = load_dataset(path, manifest, check_files=False)
    except (ConfigError, UntrustedInputError, storage.StorageError) as e:
        raise ServingError(f"the model's transforms come from its dataset's manifest, and {_first_line(e)} "
                           "(give the dataset's folder with --dataset_path)") from None  # fmt: skip
    if ds.table_sizes != cfg.model.table_sizes:
        raise ServingError(f"{path} has tables of {ds.table_sizes} rows, the checkpoint {cfg.model.table_sizes}: not its dataset")
    files = vocabulary_bytes(path, ds.vocab_files)  # sizes and checksums as the manifest records them
    return {"schema": manifest["schema"], "transforms": manifest["transforms"], PINNED: found}, files


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _report(config: dict[str, Any], output: str, log) -> None:
    ck = config["checkpoint"]
    log(
        f"exported {ck['path']} (step {ck['step']}, {counted(ck['world_size'], 'rank')}) to {output} in "
        f"{config['seconds']:.1f}s: {SCORER_FILE} {_mib(config['files'][SCORER_FILE])} "
        f"(tables {config['quantize']}), {WEIGHTS_FILE} {_mib(config['files'][WEIGHTS_FILE])}"
    )
    q = config.get("quantization")
    if q is None:
        return
    if "not_measured" in q:
        log(f"quantize {config['quantize']}: AUC change not measured ({q['not_measured']}); use --dataset_path")
        return
    log(
        f"quantize {config['quantize']}: {SCORER_FILE} {_mib(config['scorer_bytes_fp32'])} -> "
        f"{_mib(config['files'][SCORER_FILE])}; val AUC {q['auc_fp32']:.5f} -> {q['auc']:.5f} "
        f"(change {q['auc_change']:+.5f}), logloss {q['logloss_fp32']:.5f} -> {q['logloss']:.5f} "
        f"on {q['rows']} rows"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "export a training checkpoint to a model directory that serves (TorchScript + weights)"
    parser = add_command(subparsers, "export", summary, __doc__, _main)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint, a folder of them (its newest complete one) or a run folder")
    parser.add_argument("--output", required=True, metavar="DIR", help="the model directory to write (folder or URL)")
    parser.add_argument(
        "--quantize", choices=QUANTIZE, default="none", help="store the scoring module's tables as fp16 or row-wise int8"
    )
    parser.add_argument(
        "--dataset_path", default=None,
        help="the dataset it trained on, if moved (its transforms' digest must be the checkpoint's); "
             "the quantization's AUC change is measured on it (default: the run's own)",
    )  # fmt: skip
    parser.add_argument("--eval_rows", type=int, default=1_000_000, help="validation rows to measure it on, at most")
    parser.add_argument("--json", action="store_true", help="print the model config as one JSON object")
    return parser


def _main(ns: argparse.Namespace) -> int:
    log = (lambda line: print(line, file=sys.stderr)) if ns.json else print
    config = export(ns.checkpoint, ns.output, ns.quantize, ns.dataset_path, ns.eval_rows, log)
    if ns.json:
        print(json.dumps(config))
    return 0
