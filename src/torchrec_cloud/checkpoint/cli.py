"""``torchrec-cloud checkpoint ls|inspect PATH``: what is under a ``--checkpoint_path`` (local
folder or ``s3://``, ``gs://``, ``az://`` URL), and what one checkpoint holds::

    torchrec-cloud checkpoint ls s3://bucket/runs/q
    torchrec-cloud checkpoint inspect s3://bucket/runs/q/step_00000200 -v
    torchrec-cloud checkpoint ls runs/q            # a run folder: the checkpoints its run wrote
    torchrec-cloud checkpoint inspect runs/q/ckpt  # a folder of checkpoints: its newest complete one
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from torchrec_cloud import storage
from torchrec_cloud.checkpoint.dcp import read_metadata
from torchrec_cloud.checkpoint.store import (
    COMMIT_FILE,
    CheckpointError,
    CheckpointInfo,
    inspect_checkpoint,
    list_checkpoints,
)
from torchrec_cloud.metrics.run_folder import METRICS_FILE, last_run


def _human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def checkpoints_of(path: str) -> str:
    """The folder of checkpoints PATH means: PATH itself when it holds ``step_N`` folders;
    for a run folder (a ``--output_dir``, with its metrics.jsonl), the ``--checkpoint_path``
    its run wrote to, or its ``ckpt/`` or ``checkpoints/`` folder; else PATH."""
    candidates = [path]
    if storage.scheme(path) is None and Path(path, METRICS_FILE).is_file():
        start = (last_run(Path(path)) or ({}, None))[0]
        written = ((start.get("config") or {}).get("checkpoint") or {}).get("checkpoint_path")
        candidates += [written] if written else []
        candidates += [storage.join(path, "ckpt"), storage.join(path, "checkpoints")]
    return next((c for c in candidates if list_checkpoints(c)), path)


def _checkpoint_at(path: str) -> str:
    """The checkpoint PATH means: PATH itself when it is one, else the newest complete one
    (or, with none complete, the newest) in the folder of checkpoints it means."""
    if storage.exists(storage.join(path, COMMIT_FILE)) or storage.exists(storage.join(path, ".metadata")):
        return path
    root = checkpoints_of(path)
    infos = list_checkpoints(root)
    if not infos:
        return path
    chosen = next((i for i in reversed(infos) if i.complete), infos[-1])
    which = "newest complete" if chosen.complete else "newest (none is complete)"
    print(f"{path} holds checkpoints: inspecting the {which} one, {chosen.path}", file=sys.stderr)
    return chosen.path


def _ls(ns: argparse.Namespace) -> int:
    ns.path = checkpoints_of(ns.path)
    infos = list_checkpoints(ns.path)
    if ns.json:
        print(json.dumps([_info_dict(i) for i in infos]))
        return 0
    if not infos:
        if not storage.exists(ns.path):
            print(f"torchrec-cloud checkpoint ls: {ns.path} does not exist", file=sys.stderr)
            return 1
        print(f"no checkpoints under {ns.path}")
        return 0
    print(f"{'name':<16} {'step':>9} {'ranks':>5} {'size':>10}  {'created':<25} status")
    for i in infos:
        status = "complete" if i.complete else f"INCOMPLETE: {i.problem}"
        created = (i.commit or {}).get("created", "-")
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<16} {step:>9} {i.world_size or '-':>5} {_human(i.bytes):>10}  {created:<25} {status}")
    return 0


def _info_dict(i: CheckpointInfo) -> dict[str, Any]:
    trainer = (i.commit or {}).get("trainer", {})
    return {
        "path": i.path,
        "name": i.name,
        "step": i.step,
        "complete": i.complete,
        "problem": i.problem or None,
        "world_size": i.world_size,
        "bytes": i.bytes,
        "created": (i.commit or {}).get("created"),
        "epoch": trainer.get("epoch"),
        "batch": trainer.get("batch"),
        "reason": (i.commit or {}).get("reason"),
    }


def _inspect(ns: argparse.Namespace) -> int:
    ns.path = _checkpoint_at(ns.path)
    info = inspect_checkpoint(ns.path)
    out = _info_dict(info)
    if not info.complete and info.commit is None and not storage.exists(storage.join(ns.path, ".metadata")):
        print(f"torchrec-cloud checkpoint inspect: {ns.path}: {info.problem}", file=sys.stderr)
        return 1
    tensors: list[dict[str, Any]] = []
    try:
        metadata = read_metadata(ns.path)
    except CheckpointError as e:
        out["problem"] = out["problem"] or str(e)
    else:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for key, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                tensors.append(
                    {"key": key, "shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", ""),
                     "shards": len(md.chunks)}
                )
    out["tensors"] = tensors
    if ns.json:
        print(json.dumps(out))
        return 0 if info.complete else 1
    for key in ("path", "step", "epoch", "batch", "world_size", "created", "reason"):
        print(f"{key:<11} {out[key]}")
    print(f"{'size':<11} {_human(info.bytes)}" + (f" ({info.bytes} bytes)" if info.bytes is not None else ""))
    print(f"{'status':<11} " + ("complete" if info.complete else f"INCOMPLETE: {info.problem}"))
    if tensors:
        groups: dict[str, int] = {}
        for t in tensors:
            groups[t["key"].split(".", 1)[0]] = groups.get(t["key"].split(".", 1)[0], 0) + 1
        print(f"{'tensors':<11} " + ", ".join(f"{n} {g}" for g, n in groups.items()))
        if ns.verbose:
            for t in tensors:
                print(f"  {t['key']}  {t['dtype']}{t['shape']}  shards={t['shards']}")
    return 0 if info.complete else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoint",
        help="list and inspect checkpoints (a run folder, a local folder or s3://, gs://, az:// URL)",
        description="List the checkpoints under a --checkpoint_path, or inspect one.",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    sub.required = True
    ls = sub.add_parser("ls", help="checkpoints under PATH: step, ranks, size, complete or not")
    ls.add_argument("path", metavar="PATH")
    ls.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    ls.set_defaults(func=_run_cli(_ls))
    insp = sub.add_parser("inspect", help="one checkpoint: position, ranks, size, tensors")
    insp.add_argument("path", metavar="PATH")
    insp.add_argument("--json", action="store_true", help="one JSON object instead of text")
    insp.add_argument("-v", "--verbose", action="store_true", help="list every tensor")
    insp.set_defaults(func=_run_cli(_inspect))
    return parser


def _run_cli(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        try:
            return fn(ns)
        except (storage.StorageError, CheckpointError) as e:
            print(f"torchrec-cloud checkpoint {ns.action}: error: {e}", file=sys.stderr)
            return 1

    return run
