"""Tables that grew since a checkpoint: what a warm start (``train --warm_start``) loads when
the day's dataset admitted ids into rows the parent's tables did not have.

A vocabulary that grows (``data preprocess --vocab_from``, :mod:`torchrec_cloud.data.vocab`)
keeps every old id on its row and gives new ids the rows after them, so a table's first rows
are the parent's and its last ones are new. DCP loads a saved tensor only into one of the same
global shape, so a grown table (and its row-wise optimizer state) is loaded into a whole
tensor of the saved shape on every rank, then this rank's shards copy the rows they hold; the
rows after them keep the new run's own initialisation and zero optimizer state, as a table
created today would have them. A table that shrank, or changed in any other dimension, is not
a descendant: refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


def flat_leaves(state: dict[str, Any], prefix: str = "") -> dict[str, tuple[dict, str, Any]]:
    """Every tensor of a nested state dict by DCP's flattened key (the dotted path), with the
    dict that holds it and its key there."""
    import torch

    out: dict[str, tuple[dict, str, Any]] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_leaves(value, f"{path}."))
        elif isinstance(value, torch.Tensor):
            out[path] = (state, key, value)
    return out


def grown_tensors(state: dict[str, Any], metadata: Any) -> dict[str, torch.Size]:
    """The tensors of ``state`` whose checkpointed shape (``metadata``, the checkpoint's DCP
    index) has fewer rows than today's and is otherwise the same: key -> saved shape. Raises
    ValueError naming the first tensor whose shape changed in any other way."""
    import torch

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    grown: dict[str, torch.Size] = {}
    for key, (_, _, tensor) in flat_leaves(state).items():
        entry = saved.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            continue  # DCP's own check names a missing key
        was, now = tuple(entry.size), tuple(tensor.shape)
        if was == now:
            continue
        if len(was) != len(now) or not was or was[1:] != now[1:] or was[0] > now[0]:
            raise ValueError(f"{key} has shape {list(was)} in the checkpoint and {list(now)} now: only a table "
                             "that grew (more rows, the same width) can take a parent's rows")  # fmt: skip
        grown[key] = torch.Size(was)
    return grown


def stand_ins(state: dict[str, Any], grown: dict[str, torch.Size]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A copy of ``state``'s nesting in which each grown tensor is replaced by a whole CPU
    tensor of its saved shape (what DCP loads into); every other leaf is the same object, so
    it still loads in place. Returns that state and the stand-ins by key."""
    import torch

    made: dict[str, torch.Tensor] = {}

    def copy(node: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = copy(value, f"{path}.")
            elif path in grown:
                dtype = value.dtype
                made[path] = out[key] = torch.zeros(grown[path], dtype=dtype)
            else:
                out[key] = value
        return out

    return copy(state, ""), made


def copy_rows(state: dict[str, Any], made: dict[str, torch.Tensor]) -> int:
    """Each stand-in's rows into this rank's pieces of the grown tensor it stood in for
    (the parent's rows, from row 0); the pieces' later rows are left as they are. Returns
    the rows copied here."""
    leaves = flat_leaves(state)
    done = 0
    for key, whole in made.items():
        _, _, target = leaves[key]
        for piece, offsets in local_pieces(target):
            row0 = offsets[0]
            n = min(piece.shape[0], whole.shape[0] - row0)
            if n <= 0:
                continue
            if piece.dim() == 1:
                piece[:n] = whole[row0 : row0 + n].to(piece.dtype)
            else:
                col0 = offsets[1]
                piece[:n] = whole[row0 : row0 + n, col0 : col0 + piece.shape[1]].to(piece.dtype)
            done += n
    return done


def local_pieces(value: Any) -> list[tuple["torch.Tensor", tuple[int, ...]]]:
    """This rank's pieces of a (Sharded)Tensor, each with its offsets in the whole tensor."""
    import torch

    if isinstance(value, torch.Tensor) and hasattr(value, "local_shards") and not type(value) is torch.Tensor:
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return [(value, (0,) * value.dim())]
    return []


def growth_only(saved: Optional[list], now: Optional[list]) -> bool:
    """Whether a model's saved ``num_embeddings_per_feature`` differs from today's only by
    tables that grew."""
    if not isinstance(saved, list) or not isinstance(now, list) or len(saved) != len(now):
        return False
    return all(isinstance(a, int) and isinstance(b, int) and a <= b for a, b in zip(saved, now))
