"""``torchrec-cloud checkpoint ls|inspect|verify PATH``: what is under a ``--checkpoint_path``
(local folder or ``s3://``, ``gs://``, ``az://`` URL), what one checkpoint holds, and whether
its bytes are still those that were saved::

    torchrec-cloud checkpoint ls s3://bucket/runs/q
    torchrec-cloud checkpoint inspect s3://bucket/runs/q/step_00000200 -v
    torchrec-cloud checkpoint ls runs/q            # a run folder: the checkpoints its run wrote
    torchrec-cloud checkpoint inspect runs/q/ckpt  # a folder of checkpoints: its newest complete one
    torchrec-cloud checkpoint verify s3://bucket/runs/q          # exit 1 naming a damaged file

``ls`` and ``inspect`` read only each ``COMMIT.json`` and the files' sizes; with ``--verify``
they read every byte back against the checksums, as ``verify`` does, and exit 1 when one is
damaged. PATH may be a run folder (its ``--output_dir``) wherever it may be a folder of
checkpoints, as for ``export`` and ``--resume_from``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Optional

from torchrec_cloud import storage
from torchrec_cloud.checkpoint.dcp import read_metadata, verify
from torchrec_cloud.checkpoint.store import (
    COMMIT_FILE,
    CheckpointDamagedError,
    CheckpointError,
    CheckpointInfo,
    checkpoints_of,
    inspect_checkpoint,
    list_checkpoints,
)


def _human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


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
    # With --verify, a damaged checkpoint fails the listing, as it fails `verify`; without it
    # the listing is what it reads (a row whose COMMIT.json is refused says DAMAGED, exit 0).
    status = 1 if ns.verify and any(i.damaged for i in infos) else 0
    if ns.json:
        print(json.dumps([_info_dict(i) for i in infos]))
        return status
    if not infos:
        if not storage.exists(ns.path):
            raise CheckpointError(f"{ns.path} does not exist")
        print(f"no checkpoints under {ns.path}")
        return 0
    print(f"{'name':<16} {'step':>9} {'ranks':>5} {'size':>10}  {'created':<25} status")
    for i in infos:
        created = (i.commit or {}).get("created", "-")
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<16} {step:>9} {i.world_size or '-':>5} {_human(i.bytes):>10}  {created:<25} "
              f"{_status(i, ns.verify)}")
    return status


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
        "owner": (i.commit or {}).get("owner"),
    }


def _inspect(ns: argparse.Namespace) -> int:
    ns.path = _checkpoint_at(ns.path)
    info = verify(ns.path) if ns.verify else inspect_checkpoint(ns.path)
    if info.commit is None and (info.damaged or not storage.exists(storage.join(ns.path, ".metadata"))):
        raise CheckpointError(f"{ns.path}: {info.problem}")
    tensors: list[dict[str, Any]] = []
    try:
        metadata = read_metadata(ns.path, info.commit)
    except CheckpointDamagedError as e:  # not DCP's index of these files: nothing of it is shown
        info = info if info.damaged else info.as_damaged(f"{e.file}: {e.detail}")
    except CheckpointError as e:
        info = dataclasses.replace(info, problem=info.problem or str(e))
    else:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for key, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                tensors.append(
                    {"key": key, "shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", ""),
                     "shards": len(md.chunks)}
                )
    out = _info_dict(info)
    out["tensors"] = tensors
    if ns.json:
        print(json.dumps(out))
        return 0 if info.complete else 1
    for key in ("path", "step", "epoch", "batch", "world_size", "owner", "created", "reason"):
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
    if info.damaged:
        print(f"torchrec-cloud checkpoint inspect: error: {ns.path}: {_status(info)}", file=sys.stderr)
    return 0 if info.complete else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoint",
        help="list and inspect checkpoints (a run folder, a local folder or s3://, gs://, az:// URL)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    ver.add_argument("path", metavar="PATH", help="a step_N checkpoint, a folder of them, or a run folder")
    ver.set_defaults(func=_verify)
    return parser


_VERIFY_HELP = "read every byte back against the checksums saved with it (slow); a damaged one says DAMAGED (exit 1)"


def _verify(ns: argparse.Namespace) -> int:
    infos = [inspect_checkpoint(ns.path)] if _is_checkpoint(ns.path) else list_checkpoints(checkpoints_of(ns.path))
    if not infos:
        what = "does not exist" if not storage.exists(ns.path) else "holds no checkpoint"
        raise CheckpointError(f"{ns.path} {what}")
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
