"""``torchrec-cloud checkpoint ls|inspect|verify PATH``: what is under a ``--checkpoint_path``
(local folder or ``s3://``, ``gs://``, ``az://`` URL), what one checkpoint holds, and whether
its bytes are still those that were saved::

    torchrec-cloud checkpoint ls s3://bucket/runs/q
    torchrec-cloud checkpoint inspect s3://bucket/runs/q/step_00000200 -v
    torchrec-cloud checkpoint ls runs/q            # a run folder: the checkpoints its run wrote
    torchrec-cloud checkpoint inspect runs/q/ckpt  # a folder of checkpoints: its newest complete one
    torchrec-cloud checkpoint verify s3://bucket/runs/q          # exit 1 naming a damaged file

``ls`` and ``inspect`` read only each ``COMMIT.json`` and the files' sizes; with ``--verify``
they read every byte back against the checksums, as ``verify`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from torchrec_cloud import storage
from torchrec_cloud.checkpoint.dcp import read_metadata, verify
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


def _is_checkpoint(path: str) -> bool:
    """PATH is one checkpoint (committed, or at least begun by DCP), not a folder of them."""
    return storage.exists(storage.join(path, COMMIT_FILE)) or storage.exists(storage.join(path, ".metadata"))


def _checkpoint_at(path: str) -> str:
    """The checkpoint PATH means: PATH itself when it is one, else the newest complete one
    (or, with none complete, the newest) in the folder of checkpoints it means."""
    if _is_checkpoint(path):
        return path
    root = checkpoints_of(path)
    infos = list_checkpoints(root)
    if not infos:
        return path
    chosen = next((i for i in reversed(infos) if i.complete), infos[-1])
    which = "newest complete" if chosen.complete else "newest (none is complete)"
    print(f"{path} holds checkpoints: inspecting the {which} one, {chosen.path}", file=sys.stderr)
    return chosen.path


def _status(i: CheckpointInfo, verified: bool = False) -> str:
    if i.damaged:
        return f"DAMAGED: {i.problem}"
    if not i.complete:
        return f"INCOMPLETE: {i.problem}"
    if not verified:
        return "complete"
    return "complete, verified" if i.checksums else "complete (saved without checksums; .metadata readable)"


def _ls(ns: argparse.Namespace) -> int:
    ns.path = checkpoints_of(ns.path)
    infos = list_checkpoints(ns.path)
    if ns.verify:
        infos = [verify(i.path) if i.complete else i for i in infos]
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
        status = _status(i, ns.verify)
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
        "damaged": i.damaged,
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
    info = verify(ns.path) if ns.verify else inspect_checkpoint(ns.path)
    out = _info_dict(info)
    if not info.complete and info.commit is None and not storage.exists(storage.join(ns.path, ".metadata")):
        print(f"torchrec-cloud checkpoint inspect: {ns.path}: {info.problem}", file=sys.stderr)
        return 1
    tensors: list[dict[str, Any]] = []
    try:
        metadata = read_metadata(ns.path, info.commit)
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
    print(f"{'status':<11} " + _status(info, ns.verify))
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
    ls.add_argument("--verify", action="store_true", help=_VERIFY_HELP)
    ls.set_defaults(func=_ls)
    insp = sub.add_parser("inspect", help="one checkpoint: position, ranks, size, tensors")
    insp.add_argument("path", metavar="PATH")
    insp.add_argument("--json", action="store_true", help="one JSON object instead of text")
    insp.add_argument("-v", "--verbose", action="store_true", help="list every tensor")
    insp.add_argument("--verify", action="store_true", help=_VERIFY_HELP)
    insp.set_defaults(func=_inspect)
    ver = sub.add_parser(
        "verify",
        help="read every file of a checkpoint (or of every checkpoint in a folder) back against its checksums",
        description="Read every byte of a checkpoint, or of each checkpoint under a folder, and compare it "
        "with the checksums recorded when it was saved. Exit 1 naming each damaged or incomplete one.",
    )
    ver.add_argument("path", metavar="PATH", help="a step_N checkpoint, or a folder of them")
    ver.set_defaults(func=_verify)
    return parser


_VERIFY_HELP = "read every byte back against the checksums saved with it (slow); a damaged one says DAMAGED"


def _verify(ns: argparse.Namespace) -> int:
    infos = [inspect_checkpoint(ns.path)] if _is_checkpoint(ns.path) else list_checkpoints(ns.path)
    if not infos:
        what = "does not exist" if not storage.exists(ns.path) else "holds no checkpoint"
        print(f"torchrec-cloud checkpoint verify: error: {ns.path} {what}", file=sys.stderr)
        return 1
    bad = 0
    for info in infos:
        checked = verify(info.path) if info.complete else info
        line = f"{checked.path}: {_status(checked, verified=True)}"
        if checked.complete:
            print(line)
        else:
            bad += 1
            print(f"torchrec-cloud checkpoint verify: error: {line}", file=sys.stderr)
    return 1 if bad else 0
