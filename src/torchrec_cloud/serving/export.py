"""``torchrec-cloud export CHECKPOINT --output DIR``: a sharded training checkpoint to a model
directory that serves (layout in :mod:`torchrec_cloud.serving`)::

    torchrec-cloud export runs/q/checkpoints --output models/q
    torchrec-cloud export s3://bucket/runs/q/checkpoints/step_00002000 --output s3://bucket/models/q --quantize int8
    torchrec-cloud export runs/q/checkpoints --output models/q --format torchscript
    torchrec-cloud export runs/q/checkpoints --publish models/root

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

``--format`` names the scorers written: ``torchscript`` (``scorer.pt``) and ``pt2``
(``scorer.pt2``: a torch.export program compiled by AOTInductor for the CPU, and
``scorer.cuda.pt2`` for CUDA when exported on a machine with a GPU; compiling needs a C++
compiler). By default both, pt2 where it builds. Each is checked against TorchRec's logits,
and the pt2 package also on a batch of one row and on empty bags.

``--publish ROOT`` writes a new version ``ROOT/VERSION/`` and then makes ``ROOT/current``
name it (see :mod:`torchrec_cloud.serving.publish`), which ``serve ROOT`` follows; with
``--gate DATASET`` only if it scores DATASET's test split about as well as the current one::

    torchrec-cloud export runs/day2/checkpoints --publish models/daily --gate data/day2
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import time
from typing import Any, Optional, Sequence

import torch

from torchrec_cloud import counted, storage
from torchrec_cloud.checkpoint.dcp import load_full_state, read_metadata
from torchrec_cloud.checkpoint.store import COMMIT_FILE, CheckpointDamagedError, CheckpointInfo, lease, resolve
from torchrec_cloud.config import ConfigError, JobConfig, ModelConfig
from torchrec_cloud.serving import (
    CONFIG_FILE,
    MODEL_FORMAT,
    MODEL_VERSION,
    PT2_FILES,
    SCORER_FILE,
    TABLES_FILE,
    WEIGHTS_FILE,
    ServingError,
    saved_job_config,
)
from torchrec_cloud.serving.scorer import QUANTIZE, TABLE_BUFFERS, BagLogits, Scorer, Tables

FORMATS = ("torchscript", "pt2")
FILE_NAMES = (SCORER_FILE, *PT2_FILES.values())
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


def scorer_module(model: torch.nn.Module, quantize: str) -> Scorer:
    """The plain-torch scoring module of an unsharded DLRMTrain, in eval mode, no gradients."""
    dlrm = model.model
    ebc = dlrm.sparse_arch.embedding_bag_collection
    from torchrec.modules.embedding_configs import PoolingType

    configs = ebc.embedding_bag_configs()
    tables = [ebc.embedding_bags[c.name].weight for c in configs]
    mean = [c.pooling == PoolingType.MEAN for c in configs]
    scorer = Scorer(dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch, Tables(tables, quantize, mean))
    for p in scorer.parameters():
        p.requires_grad_(False)  # a server scores; no autograd graph per request
    return scorer.eval()


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


class Scorers:
    """The plain scoring module of each quantization of one model, built once (quantizing
    copies every table) and shared by the formats written, their checks and ``tables.pt``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._built: dict[str, Scorer] = {}

    def __call__(self, quantize: str) -> Scorer:
        if quantize not in self._built:
            self._built[quantize] = scorer_module(self.model, quantize)
        return self._built[quantize]


def torchscript_scorer(scorers: Scorers, quantize: str, cfg: ModelConfig, required: bool) -> dict[str, Any]:
    """``{scorer.pt: bytes, fp32_bytes: n}``: the TorchScript scorer of ``quantize``, its float32
    twin checked against TorchRec's logits. A model TorchScript cannot compile (DCNv2's
    CrossNet indexes its layers by a loop variable) stops the export when ``required``
    (``--format torchscript``), else is left out with a note: the pt2 package serves."""
    try:
        fp32 = torch.jit.script(scorers("none"))
        scorer = fp32 if quantize == "none" else torch.jit.script(scorers(quantize))
    except Exception as e:  # noqa: BLE001 - TorchScript's compiler fails in many ways
        if required:
            raise ServingError(f"cannot build {SCORER_FILE} (--format torchscript): {_first_line(e)}") from None
        print(f"torchrec-cloud export: note: no {SCORER_FILE}, the pt2 package serves (TorchScript cannot "
              f"compile this model: {_first_line(e)})", file=sys.stderr)  # fmt: skip
        return {}
    check_against_torchrec(scorers.model, fp32, cfg)
    data = _module_bytes(scorer)
    return {SCORER_FILE: data, "fp32_bytes": len(_module_bytes(fp32)) if quantize != "none" else len(data)}


def pt2_packages(scorers: Scorers, quantize: str, cfg: ModelConfig, required: bool) -> dict[str, bytes]:
    """``scorer.pt2`` (and ``scorer.cuda.pt2`` on a machine with CUDA): the scoring module of
    ``quantize`` as a torch.export program compiled by AOTInductor, each checked by
    :func:`check_pt2`. A package that does not build (no C++ compiler, say) stops the export
    when ``required`` (``--format pt2`` asked for it), else is left out with a note:
    TorchScript serves. One that builds but scores differently always stops it."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    packages: dict[str, bytes] = {}
    for device in devices:
        try:
            data = pt2_package(scorers(quantize), cfg, device)
        except Exception as e:  # noqa: BLE001 - export and the C++ build fail in many ways
            if required:
                raise ServingError(f"cannot build {PT2_FILES[device]} (--format pt2): {_first_line(e)}") from None
            print(f"torchrec-cloud export: note: no {PT2_FILES[device]}, TorchScript serves "
                  f"(torch.export or AOTInductor failed: {_first_line(e)})", file=sys.stderr)  # fmt: skip
            continue
        check_pt2(data, device, scorers.model, scorers(quantize), quantize, cfg)
        packages[PT2_FILES[device]] = data
    return packages


def pt2_package(scorer: Scorer, cfg: ModelConfig, device: str) -> bytes:
    """The bytes of an AOTInductor package of ``scorer``'s :class:`BagLogits` for ``device``.
    The batch and the number of ids are dynamic (a batch of 1 and bags of no ids included);
    the example batch only has to be neither 0 nor 1 long, which torch.export would specialise."""
    import copy
    import os
    import tempfile
    import warnings

    from torch._inductor import aoti_compile_and_package
    from torch.export import Dim
    from torch.export import export as torch_export

    program = BagLogits(copy.deepcopy(scorer)).to(device).eval()  # the TorchRec model stays on the CPU
    program.scorer.tables.bag_op = True  # pooled by aten's embedding_bag (Tables.forward says why)
    b, f = 4, cfg.num_sparse_features
    dense = torch.rand(b, cfg.num_dense_features, device=device)
    lengths = torch.arange(f * b, device=device) % 3  # 0, 1 and 2 ids a bag
    values = torch.zeros(int(lengths.sum()), dtype=torch.int64, device=device)
    batch, ids = Dim("batch", min=1), Dim("ids", min=0)
    shapes = {"dense": {0: batch}, "values": {0: ids}, "lengths": {0: f * batch}}
    with torch.no_grad(), warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="torchrec-cloud-export-") as tmp:
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations, nothing for a user to act on
        exported = torch_export(program, (dense, values, lengths), dynamic_shapes=shapes, strict=False)
        path = os.path.join(tmp, PT2_FILES[device])
        aoti_compile_and_package(exported, package_path=path)
        with open(path, "rb") as fh:
            return fh.read()


def check_pt2(data: bytes, device: str, model: torch.nn.Module, reference: Scorer, quantize: str, cfg: ModelConfig) -> None:
    """The compiled package, loaded as a server loads it, must give TorchRec's logits (the
    plain scoring module's of the same quantization when the tables are quantized) on a
    random batch, and the plain module's on a batch of one row, of one row of empty bags, and
    of rows mixing empty and full bags: the shapes a server sees that an example batch hides."""
    import os
    import tempfile

    from torchrec_cloud.serving.runtime import LoadedScorer, _load_aoti_package

    with tempfile.TemporaryDirectory(prefix="torchrec-cloud-export-") as tmp:
        path = os.path.join(tmp, PT2_FILES[device])
        with open(path, "wb") as fh:
            fh.write(data)
        loaded = LoadedScorer(_load_aoti_package(path, device), "pt2", path, device)
    if quantize == "none":
        check_against_torchrec(model, loaded, cfg)
    g = torch.Generator().manual_seed(1)
    f = cfg.num_sparse_features
    for b, lengths in ((1, torch.zeros(f, dtype=torch.int64)), (1, torch.ones(f, dtype=torch.int64)),
                       (3, torch.randint(0, 3, (f * 3,), generator=g))):  # fmt: skip
        dense = torch.rand(b, cfg.num_dense_features, generator=g)
        per_table = lengths.view(f, b).sum(dim=1).tolist()
        values = torch.cat([torch.randint(0, n, (int(k),), generator=g) for n, k in zip(cfg.table_sizes, per_table)])
        with torch.no_grad():
            expected = reference.logits_of_bags(dense, values, lengths)
        try:
            got = loaded.logits_of_bags(dense, values, lengths)
        except Exception as e:  # noqa: BLE001 - a shape the program refuses raises from its C++ runtime
            raise ServingError(f"{PT2_FILES[device]} refuses a batch of {b} "
                               f"({int(lengths.sum())} ids): {_first_line(e)}") from None  # fmt: skip
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            raise ServingError(f"{PT2_FILES[device]} disagrees with {SCORER_FILE} on a batch of {b} "
                               f"({int(lengths.sum())} ids)")  # fmt: skip


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
    formats: Optional[Sequence[str]] = None,
    lineage: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Write the model directory of ``checkpoint`` to ``output``; returns its model_config.
    ``formats``: the scorers to write (:data:`FORMATS`; None: both, pt2 where it builds);
    ``lineage``: what ``--publish`` records of the version (:mod:`.publish`)."""
    if quantize not in QUANTIZE:
        raise ConfigError("quantize", f"expected one of {', '.join(QUANTIZE)}, got {quantize!r}")
    pt2_asked = formats is not None and "pt2" in formats
    ts_asked = formats is not None and "torchscript" in formats
    formats = FORMATS if formats is None else tuple(formats)
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
    scorers = Scorers(model)
    scripted = torchscript_scorer(scorers, quantize, cfg.model, required=ts_asked) if "torchscript" in formats else {}
    packages = pt2_packages(scorers, quantize, cfg.model, required=pt2_asked or not scripted) if "pt2" in formats else {}
    weights = io.BytesIO()
    torch.save({k: v.detach().contiguous() for k, v in model.state_dict().items()}, weights)
    # What serve maps in place of the TorchScript scorer's tables, shared by its workers
    # (serving.runtime); a pt2 package keeps its own, so without scorer.pt there is none.
    tables = io.BytesIO()
    if scripted:
        torch.save({k: v.contiguous() for k, v in scorers(quantize).tables.state_dict().items()
                    if k in TABLE_BUFFERS}, tables)  # fmt: skip

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
        "files": {**{k: len(v) for k, v in {**scripted, **packages}.items() if k in FILE_NAMES},
                  WEIGHTS_FILE: len(weights.getvalue()), **({TABLES_FILE: len(tables.getvalue())} if scripted else {})},
        **({"scorer_bytes_fp32": scripted["fp32_bytes"]} if scripted else {}),
        **transforms,
    }
    if packages:
        config["pt2"] = {"torch": torch.__version__}
    if lineage is not None:
        config["lineage"] = lineage
    if quantize != "none":
        try:
            config["quantization"] = quantization_cost(scorers("none"), scorers(quantize),
                                                       cfg, eval_rows, pinned, f"checkpoint {info.path}")  # fmt: skip
        except (ConfigError, storage.StorageError) as e:
            config["quantization"] = {"not_measured": _first_line(e)}

    storage.makedirs(output)
    config_path = storage.join(output, CONFIG_FILE)
    if storage.exists(config_path):
        storage.remove(config_path)  # the folder is a model again only once all is rewritten
    for name in (SCORER_FILE, *PT2_FILES.values()):
        if name in config["files"]:
            storage.write_bytes(storage.join(output, name), {**scripted, **packages}[name])
        elif storage.exists(storage.join(output, name)):
            storage.remove(storage.join(output, name))  # an earlier export's: not this model
    storage.write_bytes(storage.join(output, WEIGHTS_FILE), weights.getvalue())
    if scripted:
        storage.write_bytes(storage.join(output, TABLES_FILE), tables.getvalue())
    elif storage.exists(storage.join(output, TABLES_FILE)):
        storage.remove(storage.join(output, TABLES_FILE))  # an earlier export's: not this model
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
        f"{config['seconds']:.1f}s: "
        + ", ".join(f"{name} {_mib(size)}" for name, size in config["files"].items())
        + f" (tables {config['quantize']})"
    )
    q = config.get("quantization")
    if q is None:
        return
    if "not_measured" in q:
        log(f"quantize {config['quantize']}: AUC change not measured ({q['not_measured']}); use --dataset_path")
        return
    sizes = (f"{SCORER_FILE} {_mib(config['scorer_bytes_fp32'])} -> {_mib(config['files'][SCORER_FILE])}; "
             if "scorer_bytes_fp32" in config else "")
    log(
        f"quantize {config['quantize']}: {sizes}val AUC {q['auc_fp32']:.5f} -> {q['auc']:.5f} "
        f"(change {q['auc_change']:+.5f}), logloss {q['logloss_fp32']:.5f} -> {q['logloss']:.5f} "
        f"on {q['rows']} rows"
    )
