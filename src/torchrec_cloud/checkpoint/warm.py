"""Warm starts (``train --warm_start CKPT``): a new run from another run's checkpoint, whose
dataset's vocabulary must descend from the checkpoint's (:func:`check_descent`); rows that
vocabulary reused for new ids start fresh (:func:`reset_rows`), and tables it grew keep their
saved rows.

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

from torchrec_cloud.checkpoint.dcp import load_error, load_planner, metadata_problem, reader, training_state
from torchrec_cloud.checkpoint.store import CheckpointDamagedError, CheckpointInfo, resolve
from torchrec_cloud.config import ConfigError

if TYPE_CHECKING:
    import torch


def flat_leaves(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every tensor of a nested state dict by DCP's flattened key (the dotted path)."""
    import torch

    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_leaves(value, f"{path}."))
        elif isinstance(value, torch.Tensor):
            out[path] = value
    return out


def grown_tensors(state: dict[str, Any], metadata: Any) -> dict[str, torch.Size]:
    """The tensors of ``state`` whose checkpointed shape (``metadata``, the checkpoint's DCP
    index) has fewer rows than today's and is otherwise the same: key -> saved shape. Raises
    ValueError naming the first tensor whose shape changed in any other way."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    grown: dict[str, torch.Size] = {}
    for key, tensor in flat_leaves(state).items():
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
                made[path] = out[key] = torch.zeros(grown[path], dtype=value.dtype)
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
        for piece, offsets in local_pieces(leaves[key]):
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


def find_target(spec: str) -> CheckpointInfo:
    """The complete checkpoint ``--warm_start`` names (a checkpoint, a folder of them or a run
    folder), its index checked; a ConfigError naming the flag otherwise."""
    try:
        target = resolve(spec)
    except ConfigError as e:
        raise ConfigError("warm_start", str(e).split(": ", 1)[-1]) from None
    problem = metadata_problem(target)
    if problem:
        raise ConfigError("warm_start", f"{target.path} is damaged: {problem}")
    return target


def load(info: CheckpointInfo, verify: bool, vocabulary: Optional[dict[str, Any]], dmp: Any, optimizer: Any,
         scheduler: Any, model_cfg: Any, seed: int, rank: int) -> None:
    """Load ``info``'s model and optimizer state (the tables' row-wise Adagrad state
    included; any saved rank count, as a resume) into a new run whose learning-rate schedule
    starts again from its own flags. Tables the dataset's vocabulary grew since the checkpoint
    take its rows (:func:`grown_tensors`); the rows the dataset reused for new ids (its
    vocabulary's ``reset_rows``) get fresh weights, drawn as the table's own initialisation
    draws them, and no optimizer state."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint import load as dcp_load

    assert info.commit is not None
    source = reader(info.path, info.commit, checksums=verify)
    state = training_state(dmp, optimizer, rank)
    try:
        grown = grown_tensors(state, source.read_metadata())
    except ValueError as e:
        raise ConfigError("warm_start", f"{info.path}: {e}") from None
    into, made = stand_ins(state, grown)
    try:
        dcp_load(into, storage_reader=source, planner=load_planner(info.path))
    except CheckpointDamagedError as e:
        raise ConfigError("warm_start", f"{info.path} is damaged: {e.file}: {e.detail}") from e
    except (CheckpointException, Exception) as e:
        raise load_error(info.path, e) from e
    copy_rows(state, made)
    if resets_rows(info, vocabulary):
        reset_rows(state, (vocabulary or {}).get("reset_rows") or {}, model_cfg, seed)
    fresh = scheduler.state_dict()
    dmp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(fresh)  # the saved param groups' rates give way to this run's schedule


def resets_rows(info: CheckpointInfo, vocabulary: Optional[dict[str, Any]]) -> bool:
    """Whether the dataset reused rows since ``info``'s vocabulary (its own is not the
    checkpoint's)."""
    return vocabulary is not None and saved_vocabulary_digest(info) != vocabulary.get("digest")


VOCABULARY = "vocabulary"
"""The key of the vocabulary a checkpoint trained with (``{"version", "digest"}``) in its
COMMIT.json: what ``--warm_start`` checks the next dataset's lineage against."""


def saved_vocabulary_digest(info: CheckpointInfo) -> Optional[str]:
    """The digest of the vocabulary ``info`` trained with: its COMMIT.json's ``vocabulary``,
    or, for a checkpoint saved before that was recorded, the digest of its pinned transforms
    (what an old manifest's vocabulary version 0 is named by); None when it records neither."""
    commit = info.commit or {}
    for found in ((commit.get(VOCABULARY) or {}), (commit.get("pinned_transforms") or {})):
        if isinstance(found, dict) and isinstance(found.get("digest"), str):
            return found["digest"]
    return None


def check_descent(info: CheckpointInfo, vocabulary: Optional[dict[str, Any]], pinned: Optional[dict[str, str]] = None) -> None:
    """A ConfigError (--warm_start) unless the dataset's ``vocabulary`` descends from the one
    ``info`` trained with: the same digest, or one of its ancestors. Data without vocabularies
    (hash or modulo mappings only, Criteo) keeps every id's row by construction: the model
    check (the same features and table sizes) is all it needs. A checkpoint saved before
    checkpoints recorded their vocabulary passes on the very transforms it pinned (``pinned``:
    this run's)."""
    if vocabulary is None:
        return
    commit = info.commit or {}
    before = commit.get("pinned_transforms") if commit.get(VOCABULARY) is None else None
    if isinstance(before, dict) and pinned is not None and before.get("digest") == pinned.get("digest"):
        return
    saved = saved_vocabulary_digest(info)
    mine = vocabulary.get("digest")
    ancestors = [a for a in vocabulary.get("ancestors") or [] if isinstance(a, str)]
    if saved is not None and (saved == mine or saved in ancestors):
        return
    theirs = f"vocabulary {str(saved)[:16]}" if saved is not None else "no recorded vocabulary"
    raise ConfigError("warm_start", f"{info.path} was trained on {theirs}; this dataset's vocabulary "
                      f"{str(mine)[:16]} (version {vocabulary.get('version')}) does not descend from it (not it, nor "
                      f"any of its {len(ancestors)} ancestors): its ids would reach other rows. Preprocess the day "
                      "with --vocab_from the dataset that checkpoint trained on, or train cold")  # fmt: skip


def _table_fqns(state: dict[str, Any], table: str) -> tuple[list[str], list[tuple[str, ...]]]:
    """The model keys of ``table``'s weight and the optimizer-state paths of its row-wise state
    in a training state (``dcp.training_state``)."""
    weights = [k for k in state["model"] if k.endswith(f".{table}.weight")]
    found: list[tuple[str, ...]] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif any(f".{table}." in p or p.startswith(f"{table}.") for p in path):
            found.append(path)

    walk(state["optimizer"].get("state", {}), ("state",))
    return weights, found


def reset_rows(state: dict[str, Any], rows_by_feature: dict[str, list[int]], model_cfg: Any, seed: int) -> int:
    """Give the ``rows_by_feature`` of each table, in this rank's pieces of ``state``, the
    weights a fresh initialisation of that table draws (uniform in the table's init range, as
    torchrec 1.8 ``BatchedFusedEmbeddingBag.init_parameters`` draws them from
    ``EmbeddingBagConfig.get_weight_init_min/max``), and zero row-wise optimizer state. The
    fresh rows come from one generator per table seeded by ``seed`` and the table's name, so
    every rank, whatever its shard, draws the same rows. Returns the rows reset here."""
    import zlib

    import torch

    from torchrec_cloud.model import table_configs

    configs = {c.feature_names[0]: c for c in table_configs(model_cfg)}
    done = 0
    for feature, rows in sorted(rows_by_feature.items()):
        config = configs.get(feature)
        if config is None or not rows:
            continue
        index = torch.tensor(sorted({int(r) for r in rows if 0 <= int(r) < config.num_embeddings}), dtype=torch.long)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(config.name.encode()))
        fresh = torch.empty(len(index), config.embedding_dim).uniform_(
            config.get_weight_init_min(), config.get_weight_init_max(), generator=generator)  # fmt: skip
        weights, optimizer_paths = _table_fqns(state, config.name)
        for key in weights:
            for piece, (row0, col0) in local_pieces(state["model"][key]):
                mine = (index >= row0) & (index < row0 + piece.shape[0])
                piece[index[mine] - row0] = fresh[mine][:, col0 : col0 + piece.shape[1]].to(piece.dtype)
                done += int(mine.sum())
        for path in optimizer_paths:
            node: Any = state["optimizer"]
            for p in path:
                node = node[p]
            for piece, offsets in local_pieces(node):
                if piece.dim() == 0:
                    continue  # a step count, not a row's state
                row0 = offsets[0]
                mine = (index >= row0) & (index < row0 + piece.shape[0])
                piece[index[mine] - row0] = 0
    return done
