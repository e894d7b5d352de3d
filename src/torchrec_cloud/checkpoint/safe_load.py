"""A checkpoint read as untrusted input: DCP's ``.metadata`` and its non-tensor entries, loaded
without running anything they hold (docs/security.md).

torch 2.13's DCP trusts its files: ``FileSystemReader.read_metadata`` unpickles ``.metadata``
with ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` loads every non-tensor entry with
``torch.load(weights_only=False)``; either runs whatever code the bytes name. Here instead:

- ``.metadata`` (at most :data:`METADATA_MAX_BYTES`) is unpickled by :class:`MetadataUnpickler`,
  which admits only DCP's metadata classes and the torch types they hold (pickle's documented
  way to restrict globals: ``find_class``). torch's own weights-only unpickler
  (``torch/_weights_only_unpickler.py``) cannot read it: it implements the opcodes of pickle
  protocol 2, which ``torch.save`` writes, while DCP writes ``.metadata`` with pickle's default
  protocol (4: FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE);
- :func:`check_metadata` then checks what DCP will do with it, before it allocates or reads
  anything: every file it names is a plain name held by the checkpoint, every byte range lies
  inside that file and no two overlap, every tensor's chunks lie inside the tensor and each fits
  its byte range, the nested-key paths stay small. What a load allocates is then bounded by the
  bytes of the checkpoint's files;
- non-tensor entries (DCP saves each with ``torch.save``; ours hold none since the RNG states
  are tensors, older checkpoints' RNG states were) load with
  ``torch.load(weights_only=True)`` (:func:`load_object`). numpy's RNG state holds an array: the
  numpy names it needs are admitted through ``torch.serialization.safe_globals``, which fits
  here (its unpickler reads what ``torch.save`` writes), with numpy's array rebuilder replaced by
  one that starts from an empty array, so the array holds only the bytes the entry holds.
  Checkpoints already written load unchanged.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Optional

from torchrec_cloud.checkpoint.store import CheckpointDamagedError
from torchrec_cloud.untrusted import UntrustedInputError, check_name, shown

METADATA_FILE = ".metadata"
METADATA_MAX_BYTES = 64 << 20
"""Largest ``.metadata`` read (a few hundred bytes per tensor shard: a 64-rank DLRM's is a few MB)."""
_MAX_DIMS = 16
_MAX_PATH_DEPTH = 64

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "_MEM_FORMAT_ENCODING"),
    (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
}  # fmt: skip
"""What DCP's ``.metadata`` holds (torch 2.13, torch/distributed/checkpoint/metadata.py and
filesystem.py's ``_StorageInfo``), besides torch dtypes and a ``pathlib`` path (see find_class)."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata classes and torch's dtype, layout and
    memory-format values, and nothing else: any other global is an ``UnpicklingError``, so
    no function of the file's choosing is ever called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None) if name.isidentifier() else None
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):
            return PurePosixPath  # StorageMeta.checkpoint_id of a local save; a pure path opens nothing
        if module == "pathlib" and name in ("WindowsPath", "PureWindowsPath"):
            return PureWindowsPath
        raise pickle.UnpicklingError(f"{shown(module)}.{shown(name)} is not allowed in a checkpoint's .metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in a checkpoint's .metadata")


def load_metadata(data: bytes, checkpoint: str, sizes: dict[str, int]) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata``, checked against ``sizes`` (every
    file of the checkpoint and its size); a :class:`CheckpointDamagedError` naming
    ``.metadata`` otherwise."""
    if len(data) > METADATA_MAX_BYTES:
        raise CheckpointDamagedError(checkpoint, METADATA_FILE, f"larger than {METADATA_MAX_BYTES} bytes")
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - damaged or crafted bytes fail in many ways
        raise CheckpointDamagedError(checkpoint, METADATA_FILE, f"not a DCP index this version reads "
                                     f"({type(e).__name__}: {shown(str(e), 160)})") from None  # fmt: skip
    try:
        check_metadata(metadata, checkpoint, sizes)
    except UntrustedInputError as e:
        raise CheckpointDamagedError(checkpoint, METADATA_FILE, f"{e.field}: {e.problem}" if e.field else e.problem) from None
    return metadata


def _size(value: Any, where: str, field: str) -> tuple[int, ...]:
    import torch

    if type(value) is not torch.Size or len(value) > _MAX_DIMS or any(type(d) is not int or d < 0 for d in value):
        raise UntrustedInputError(where, field, f"must be a torch.Size of at most {_MAX_DIMS} sizes >= 0, "
                                  f"got {shown(value)}")  # fmt: skip
    return tuple(value)


def check_metadata(metadata: Any, checkpoint: str, sizes: dict[str, int]) -> None:
    """Raise :class:`~torchrec_cloud.untrusted.UntrustedInputError` unless ``metadata`` is what
    DCP wrote for the files in ``sizes`` (see the module docstring)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    where = f"{checkpoint}/{METADATA_FILE}"

    def fail(field: str, problem: str) -> None:
        raise UntrustedInputError(where, field, problem)

    if type(metadata) is not Metadata:
        fail("", f"holds a {shown(type(metadata).__name__)}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        fail("state_dict_metadata", "must be a dict")
    tensors: dict[str, tuple[Any, int]] = {}
    for key, md in entries.items():
        if type(key) is not str or len(key) > 1024:
            fail("state_dict_metadata", f"key {shown(key)} is not a name")
        if type(md) is BytesStorageMetadata:
            continue
        if type(md) is not TensorStorageMetadata:
            fail(key, f"is a {shown(type(md).__name__)}, not a tensor's or bytes' metadata")
        props = md.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
            fail(key, "has no tensor properties")
        if props.layout is not torch.strided or not isinstance(props.memory_format, torch.memory_format):
            fail(key, "is not a dense tensor")
        shape = _size(md.size, where, f"{key}.size")
        if type(md.chunks) is not list:
            fail(key, "chunks must be a list")
        covered = 0
        for i, chunk in enumerate(md.chunks):
            if type(chunk) is not ChunkStorageMetadata:
                fail(f"{key}.chunks[{i}]", "is not a chunk")
            offsets = _size(chunk.offsets, where, f"{key}.chunks[{i}].offsets")
            lengths = _size(chunk.sizes, where, f"{key}.chunks[{i}].sizes")
            if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
                o + n > s for o, n, s in zip(offsets, lengths, shape)
            ):
                fail(f"{key}.chunks[{i}]", f"offsets {list(offsets)} and sizes {list(lengths)} are outside the "
                     f"tensor's {list(shape)}")  # fmt: skip
            covered += math.prod(lengths)
        if math.prod(shape) > covered:
            fail(key, f"a tensor of {list(shape)} whose chunks hold {covered} elements")
        tensors[key] = (md, props.dtype.itemsize)

    storage = metadata.storage_data
    if type(storage) is not dict:
        fail("storage_data", "must be a dict")
    ranges: dict[str, list[tuple[int, int]]] = {}
    lengths_at: dict[tuple[str, tuple[int, ...]], int] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str or index.fqn not in entries:
            fail("storage_data", f"{shown(index)} names no entry of the checkpoint")
        field = f"storage_data[{shown(index.fqn)}]"
        if type(info) is not _StorageInfo:
            fail(field, f"is a {shown(type(info).__name__)}, not a file range")
        name = check_name(info.relative_path, where, field)
        if name not in sizes:
            fail(field, f"names {shown(name)}, which the checkpoint does not hold")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0 \
                or info.offset + info.length > sizes[name]:  # fmt: skip
            fail(field, f"bytes {shown(info.offset)}+{shown(info.length)} are outside {name} ({sizes[name]} bytes)")
        if getattr(info, "transform_descriptors", None):
            fail(field, "names storage transforms (compression), which torchrec-cloud does not write")
        ranges.setdefault(name, []).append((info.offset, info.offset + info.length))
        if index.offset is not None:
            lengths_at[(index.fqn, _size(index.offset, where, field))] = info.length
    for name, spans in ranges.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                fail("storage_data", f"two entries share bytes of {name} (at {start})")
    for key, (md, itemsize) in tensors.items():
        for i, chunk in enumerate(md.chunks):
            length = lengths_at.get((key, tuple(chunk.offsets)))
            if length is None:
                fail(f"{key}.chunks[{i}]", "has no bytes in storage_data")
            if math.prod(chunk.sizes) * itemsize > length:
                fail(f"{key}.chunks[{i}]", f"{list(chunk.sizes)} elements of {itemsize} bytes in {length} bytes")

    planner_data = metadata.planner_data
    if planner_data is not None:
        if type(planner_data) is not dict:
            fail("planner_data", "must be a dict")
        lists: dict[tuple, int] = {}
        for key, path in planner_data.items():
            if type(path) not in (tuple, list) or len(path) > _MAX_PATH_DEPTH:
                fail(f"planner_data[{shown(key)}]", "must be a short key path")
            for depth, part in enumerate(path):
                if type(part) is int and part >= 0:
                    prefix = tuple(path[:depth])
                    lists[prefix] = max(lists.get(prefix, 0), part + 1)
                elif type(part) is not str:
                    fail(f"planner_data[{shown(key)}]", f"{shown(part)} is not a key")
        # DCP builds the nested state dict from these paths, extending a list to each index.
        if sum(lists.values()) > len(entries) + 1024:
            fail("planner_data", "its list indices would build lists longer than the checkpoint's entries")


_NUMPY_ARRAY = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")


def _numpy_globals() -> list:
    """What ``torch.save`` of a numpy array of numbers names (numpy 1 and 2), for
    ``torch.serialization.safe_globals``: the array class, ``numpy.dtype`` and the numeric dtype
    classes (no object dtype), and numpy's array rebuilder replaced by :func:`_empty_array`."""
    import numpy as np

    dtypes = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFD"}
    return [np.ndarray, np.dtype, *dtypes, *((_empty_array, name) for name in _NUMPY_ARRAY)]


def _empty_array(subtype: Any, shape: Any, dtype: Any) -> Any:
    """numpy's ``_reconstruct`` as pickles call it (an empty array that ``__setstate__`` then
    fills from the entry's bytes), refusing any other shape: an array never gets more memory
    than its bytes in the file."""
    import numpy as np

    if subtype is not np.ndarray or tuple(shape) != (0,):
        raise pickle.UnpicklingError(f"an array rebuilt as {shown(subtype)}{shown(shape)}, not as numpy pickles one")
    return np.empty(0, dtype=np.uint8)


def load_object(value: io.BytesIO, checkpoint: str, fqn: str) -> Any:
    """A non-tensor entry of a checkpoint (``torch.save``'s bytes), loaded with
    ``torch.load(weights_only=True)``; a :class:`CheckpointDamagedError` naming it otherwise."""
    import torch

    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - damaged or crafted bytes fail in many ways
        first = re.split(r"[.\n]", str(e).strip(), maxsplit=1)[0]
        raise CheckpointDamagedError(checkpoint, fqn, f"does not load as data ({type(e).__name__}: "
                                     f"{shown(first, 160)})") from None  # fmt: skip


def file_sizes(checkpoint: str, commit: Optional[dict[str, Any]]) -> dict[str, int]:
    """Every file of a checkpoint and its size: its ``COMMIT.json``'s (checked), or, for one
    without, a listing of its folder, each file checked to be a regular file inside it."""
    from torchrec_cloud import storage
    from torchrec_cloud.untrusted import local_member

    if commit is not None:
        return dict(commit["files"])
    sizes = storage.list_sizes(checkpoint)
    for name in sizes:
        try:
            local_member(checkpoint, name, checkpoint, "files")
        except UntrustedInputError as e:
            raise CheckpointDamagedError(checkpoint, name, e.problem) from None
    return sizes
