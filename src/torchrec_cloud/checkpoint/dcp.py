"""What a checkpoint holds, and torch.distributed.checkpoint (DCP) bound to our storage.

``training_state`` is the state dict DCP saves and loads in place; ``writer`` and ``reader``
give DCP a file system for a local folder or a bucket URL (through
:mod:`torchrec_cloud.storage`'s fsspec client) that hashes every file as it is written and
checks every block against those checksums as it is read (:mod:`torchrec_cloud.checksum`);
``private_copy`` makes a copy that training cannot change, for an asynchronous save. The
private DCP and ShardedTensor names used here come from :mod:`torchrec_cloud.compat`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import os
import random
import threading
from typing import TYPE_CHECKING, Any, Iterator, Optional

from torchrec_cloud import checksum, compat, storage
from torchrec_cloud.checkpoint.store import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointInfo,
    inspect_checkpoint,
    verify_checkpoint,
)

if TYPE_CHECKING:  # torch loads only where a command needs it: `checkpoint ls` does not
    import torch


def rng_state(device: "torch.device") -> dict[str, "torch.Tensor"]:
    """This rank's random generators as plain tensors (loading them needs no unpickling):
    ``torch`` (the CPU generator), ``python`` and ``numpy`` (the global Mersenne Twisters,
    float64: every word is exact), and ``cuda`` on a rank that runs on a GPU: the generator of
    its own device only. One key per generator, whatever the number of GPUs a process sees,
    so a checkpoint saved with 0, 1 or 8 visible GPUs resumes on any other (a rank loads the
    keys that both it and the checkpoint have: :func:`rng_keys`)."""
    import numpy as np
    import torch

    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    assert name == "MT19937", name
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words, math.nan if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*keys.tolist(), pos, has_gauss, cached], dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, "torch.Tensor"], device: "torch.device") -> None:
    """Restore the generators :func:`rng_state` saved that are in ``state``."""
    import numpy as np
    import torch

    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        values = state["python"].tolist()
        random.setstate((int(values[0]), tuple(int(v) for v in values[1:-1]),
                         None if math.isnan(values[-1]) else values[-1]))  # fmt: skip
    if "numpy" in state:
        values = state["numpy"].tolist()
        np.random.set_state(("MT19937", np.array(values[:-3], dtype=np.uint32), int(values[-3]), int(values[-2]),
                             values[-1]))  # fmt: skip
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def rng_keys(metadata: Any, rank: int, device: "torch.device") -> dict[str, "torch.Tensor"]:
    """The generators of rank ``rank`` that the checkpoint with DCP ``metadata`` holds as
    tensors of the size this process has, as tensors to load into: the CPU ones always, the
    CUDA one only on a GPU rank (a CPU or 1-GPU checkpoint on an 8-GPU node, or a GPU one on a
    CPU, resumes with the generators both sides have); a rank the saving run did not have
    keeps its seeded ones, as do generators an older checkpoint saved pickled."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    out = {}
    for name, tensor in rng_state(device).items():
        entry = saved.get(f"rng.rank_{rank}.{name}")
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(tensor.shape):
            out[name] = tensor
    return out


def training_state(dmp: torch.nn.Module, optimizer: Any, rank: int, rng: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The state dict DCP saves and loads in place.

    ``model``: ``dmp.state_dict()`` has the same keys on any number of ranks (DMP strips
    the DDP ``module.`` prefix of the dense part); tables are ShardedTensors. ``optimizer``:
    the CombinedOptimizer's state by parameter FQN: the fused row-wise Adagrad's
    ``<table>.momentum1`` ShardedTensors (each rank lists its own tables) and the dense
    Adagrad's ``sum``/``step``. ``rng``: this rank's generators (:func:`rng_state`), under a
    key of its own (``rng.rank_R.NAME``): they differ per rank.
    """
    state: dict[str, Any] = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
    if rng:
        state["rng"] = {f"rank_{rank}": rng}
    return state


def private_copy(state: Any) -> Any:
    """A copy of the state that training cannot change while a background thread writes it.

    DCP's default stager deep-copies each ShardedTensor. TorchRec's table shards are views
    into one buffer holding all of a rank's tables, and deep-copying a view copies its whole
    buffer, once per table. Cloning a shard copies only its own rows.
    """
    import torch

    Shard, ShardedTensor = compat.sharded_tensor_types()
    if isinstance(state, dict):
        return {key: private_copy(value) for key, value in state.items()}
    if isinstance(state, ShardedTensor):
        local = state.local_shards()
        if local and local[0].tensor.device.type != "cpu":
            return state.to("cpu")  # copies each local shard's rows to host memory
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in local]
        return compat.sharded_tensor_like(state, shards)
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


def writer(path: str, checksums: bool = True):
    """DCP's file-system writer for a local folder, or bound to the storage layer's fsspec
    client for a bucket URL (one place decides URL options and credentials). With
    ``checksums``, every file is hashed as its bytes are written (or uploaded); after the
    save, rank 0's ``writer.file_checksums()`` holds every rank's."""
    # Object stores publish a file when its upload completes; fsync is for local disks.
    return _bind(_writer_class()(path, sync_files=not storage.is_url(path)), path, checksums, None)


def reader(path: str, commit: Optional[dict[str, Any]] = None, checksums: bool = True):
    """DCP's file-system reader for ``path`` (as :func:`writer`), which reads ``.metadata`` as
    untrusted input (:mod:`.safe_load`: checked against the files ``commit`` lists, or the
    folder holds). Given the checkpoint's ``COMMIT.json`` with checksums (and ``checksums``),
    every block read is checked against them, and a difference raises
    :class:`CheckpointDamagedError` naming the file (no byte is read twice for it)."""
    recorded = (commit or {}).get("checksums") if checksums else None
    expected = None
    if recorded is not None:
        sizes = commit["files"]  # type: ignore[index]
        expected = {name: (sizes[name], blocks) for name, blocks in recorded["files"].items() if name in sizes}
    handle = _reader_class()(path)
    handle.commit = commit
    return _bind(handle, path, False, expected, recorded and int(recorded["block_bytes"]))


_READER: Optional[type] = None


def _reader_class() -> type:
    """DCP's FileSystemReader whose ``read_metadata`` unpickles ``.metadata`` with
    :class:`~.safe_load.MetadataUnpickler` and checks it (once per reader) instead of
    ``pickle.load``. No ``rank`` keyword: DCP then does not fall back to per-rank metadata,
    which torchrec-cloud never writes."""
    global _READER
    if _READER is not None:
        return _READER
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from torchrec_cloud.checkpoint import safe_load

    class UntrustingReader(FileSystemReader):
        commit: Optional[dict[str, Any]] = None
        _metadata: Any = None

        def read_metadata(self, *args: Any) -> Any:
            if self._metadata is None:
                root = str(self.path)
                with self.fs.create_stream(self.fs.concat_path(self.path, safe_load.METADATA_FILE), "rb") as f:
                    data = f.read(safe_load.METADATA_MAX_BYTES + 1)
                self._metadata = safe_load.load_metadata(data, root, safe_load.file_sizes(root, self.commit))
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    _READER = UntrustingReader
    return _READER


def load_planner(path: str, whole: bool = False):
    """DCP's load planner (``whole``: the one that rebuilds a whole state dict from the
    checkpoint's own index) with every non-tensor entry loaded by
    :func:`~.safe_load.load_object` (``torch.load(weights_only=True)``)."""
    from torchrec_cloud.checkpoint import safe_load

    return compat.data_only_load_planner(lambda value, fqn: safe_load.load_object(value, path, fqn), whole)


def _bind(handle, path: str, hash_writes: bool, expected, block_bytes: Optional[int] = None):
    fs = compat.dcp_file_system(handle)
    if storage.is_url(path):
        class StorageFileSystem(compat.fsspec_filesystem()):
            def init_path(self, p, **kwargs):
                self.fs, _ = storage.filesystem(str(p))
                return p

        fs = StorageFileSystem()
        handle.path = fs.init_path(path)
    if hash_writes or expected is not None:
        fs = _ChecksummedFileSystem(fs, path, expected, block_bytes or checksum.BLOCK_BYTES, hash_writes)
    compat.set_dcp_file_system(handle, fs)
    return handle


_WRITER: Optional[type] = None


def _writer_class() -> type:
    """DCP's FileSystemWriter whose ranks hand the checksums of the files they wrote to rank 0
    with their write results (DCP gathers those to rank 0 for ``finish``, which writes
    ``.metadata``), so no collective of our own is needed, for a sync or an async save."""
    global _WRITER
    if _WRITER is not None:
        return _WRITER
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class ChecksummingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            done = super().write_data(plan, planner)
            fs = compat.dcp_file_system(self)
            if not isinstance(fs, _ChecksummedFileSystem):
                return done
            done.wait()
            mine = WriteResult(index=MetadataIndex(_CHECKSUMS_KEY), size_in_bytes=0,
                               storage_data=_RankChecksums(dict(fs.written)))  # fmt: skip
            out: Future = Future()
            out.set_result([*done.value(), mine])
            return out

        def finish(self, metadata, results):
            self.gathered = {}
            kept = []
            for rank_results in results:
                for r in rank_results:
                    if isinstance(r.storage_data, _RankChecksums):
                        self.gathered.update(r.storage_data.files)
                kept.append([r for r in rank_results if not isinstance(r.storage_data, _RankChecksums)])
            super().finish(metadata, kept)

        def file_checksums(self) -> Optional[dict[str, Optional[list[str]]]]:
            """Rank 0, after the save: every file's block checksums (None where a file was
            not written in order, to be hashed afterwards); None without checksums."""
            fs = compat.dcp_file_system(self)
            if not isinstance(fs, _ChecksummedFileSystem):
                return None
            return {**getattr(self, "gathered", {}), **fs.written}

    _WRITER = ChecksummingWriter
    return _WRITER


_CHECKSUMS_KEY = "torchrec_cloud.checksums"


@dataclasses.dataclass
class _RankChecksums:
    files: dict[str, Optional[list[str]]]


class _ChecksummedFileSystem:
    """DCP's file system (local or fsspec) with every file written hashed on its way out, and
    every file read with recorded checksums verified block by block on its way in."""

    def __init__(self, inner: Any, root: str, expected, block_bytes: int, hash_writes: bool) -> None:
        self._inner, self._root = inner, root
        self.expected: dict[str, tuple[int, list[str]]] = expected or {}
        self.block_bytes, self.hash_writes = block_bytes, hash_writes
        self.written: dict[str, Optional[list[str]]] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        with self._inner.create_stream(path, mode) as stream:
            if "r" in mode:
                expected = self.expected.get(name)
                yield stream if expected is None else _VerifiedReader(stream, self._root, name, *expected,
                                                                      self.block_bytes)  # fmt: skip
                return
            if not self.hash_writes:
                yield stream
                return
            hashing = _HashingWriter(stream, self.block_bytes)
            yield hashing
        with self._lock:
            self.written[name] = hashing.blocks()

    def rename(self, path, new_path) -> None:
        self._inner.rename(path, new_path)  # .metadata is written under a temporary name
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        with self._lock:
            if old in self.written:
                self.written[new] = self.written.pop(old)


class _HashingWriter:
    """A write stream that hashes the bytes written through it (DCP writes each file in order;
    one that seeks gets no checksums here and is hashed after the save instead)."""

    def __init__(self, stream: Any, block_bytes: int) -> None:
        self._stream = stream
        self._hasher: Optional[checksum.BlockHasher] = checksum.BlockHasher(block_bytes)

    def write(self, data) -> int:
        if self._hasher is not None:
            self._hasher.update(data)
        return self._stream.write(data)

    def seek(self, *args) -> int:
        self._hasher = None
        return self._stream.seek(*args)

    def blocks(self) -> Optional[list[str]]:
        return None if self._hasher is None else self._hasher.blocks()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close
        return getattr(self._stream, name)


_KEPT_BLOCKS = 3
"""Blocks read whole for part of them, kept: torch.load reads a tensor's record at its end,
then its start, then its data, and the next tensor starts in the block where this one ends;
with fewer kept, those blocks would be fetched again (a third more bytes from a bucket)."""


class _VerifiedReader(io.RawIOBase):
    """A read stream over one checkpoint file that checks each block it reads against the
    file's recorded checksums. A block read only in part is read whole once (its checksum
    covers all of it) and kept for the next reads; a block already checked is read as asked."""

    def __init__(self, stream: Any, root: str, name: str, size: int, blocks: list[str], block_bytes: int) -> None:
        super().__init__()
        self._raw, self._root, self._name = stream, root, name
        self._size, self._blocks, self._block = size, blocks, block_bytes
        self._pos = 0
        self._raw_pos: Optional[int] = None
        self._checked: set[int] = set()
        self._kept: dict[int, bytearray] = {}  # oldest first

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self._size - self._pos))
        pos, end, k = self._pos, self._pos + n, self._pos // self._block
        while pos < end:
            start, stop = k * self._block, min((k + 1) * self._block, self._size)
            piece = out[pos - self._pos : min(end, stop) - self._pos]
            if k in self._kept:
                piece[:] = memoryview(self._kept[k])[pos - start : pos - start + len(piece)]
            elif k in self._checked:
                self._read_raw(pos, piece)
            elif len(piece) == stop - start:
                self._read_raw(start, piece)
                self._check(k, piece)
            else:
                whole = bytearray(stop - start)
                self._read_raw(start, memoryview(whole))
                self._check(k, whole)
                self._kept[k] = whole
                if len(self._kept) > _KEPT_BLOCKS:
                    del self._kept[next(iter(self._kept))]
                piece[:] = memoryview(whole)[pos - start : pos - start + len(piece)]
            pos += len(piece)
            k += 1
        self._pos = end
        return n

    def _read_raw(self, offset: int, into: memoryview) -> None:
        if self._raw_pos != offset:
            self._raw.seek(offset)
        got = 0
        while got < len(into):
            n = self._raw.readinto(into[got:])
            if not n:
                raise CheckpointDamagedError(self._root, self._name, f"ends at byte {offset + got}, before the "
                                             f"{self._size} bytes that were saved")  # fmt: skip
            got += n
        self._raw_pos = offset + got

    def _check(self, k: int, data) -> None:
        self._checked.add(k)
        if k >= len(self._blocks) or checksum.digest(data) != self._blocks[k]:
            self._checked.discard(k)
            raise CheckpointDamagedError(self._root, self._name, checksum.describe_block(k, self._size, self._block))


def read_metadata(path: str, commit: Optional[dict[str, Any]] = None):
    """DCP's index of a checkpoint: every saved key with its size, dtype and shards, checked
    against the checkpoint's files (and its checksums when ``commit`` has them). A damaged or
    crafted one raises :class:`CheckpointDamagedError` naming ``.metadata``."""
    return _index(reader(path, commit), path)


def _index(source: Any, path: str) -> Any:
    try:
        return source.read_metadata()
    except (storage.StorageError, CheckpointDamagedError):
        raise
    except Exception as e:  # noqa: BLE001 - a missing .metadata, any backend
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(e).__name__}: {e})") from e


def metadata_problem(info: CheckpointInfo) -> str:
    """Why ``info``'s ``.metadata`` (DCP's index, which every rank reads first) cannot be used,
    or "": its bytes differ from their checksum, it is not DCP's index of these files (damaged,
    or crafted), or it cannot be read. A storage error is raised, not reported: it says nothing
    of the bytes."""
    try:
        read_metadata(info.path, info.commit)
    except CheckpointDamagedError as e:
        return f"{e.file}: {e.detail}"
    except CheckpointError as e:
        return f".metadata cannot be read ({str(e).split('(', 1)[-1].rstrip(')')})"
    return ""


def verify(path: str) -> CheckpointInfo:
    """:func:`~torchrec_cloud.checkpoint.store.verify_checkpoint`, then whether its
    ``.metadata`` is DCP's index of its files (all a checkpoint saved without checksums can be
    checked for; one with checksums could still have been written whole by another hand)."""
    info = verify_checkpoint(path)
    if info.complete:
        problem = metadata_problem(info)
        if problem:
            return info.as_damaged(problem)
    return info


def load_full_state(path: str) -> dict[str, Any]:
    """The whole checkpoint as plain, unsharded tensors in this one process (no process
    group): for inspection, tests and export. Keys are DCP's flattened FQNs. What it
    allocates is bounded by the checkpoint's files (its ``.metadata`` is checked first)."""
    from torch.distributed.checkpoint import CheckpointException

    info = inspect_checkpoint(path)
    source = reader(path, info.commit)
    _index(source, path)  # its own error first: DCP would log a traceback and look for per-rank indexes
    try:
        return compat.load_whole(source, load_planner(path, whole=True))
    except CheckpointException as e:
        raise load_error(path, e) from e


def load_error(path: str, e: BaseException) -> CheckpointError:
    """The error to raise for a failed DCP load: the first rank's :class:`CheckpointDamagedError`
    where a block did not match its checksum, else a :class:`CheckpointError` saying what failed.
    DCP's ``CheckpointException`` carries every rank's error, the same on every rank."""
    failures = getattr(e, "failures", None)
    errors = [error for _, (error, _) in sorted(failures.items())] if failures else [e]
    damaged = [error for error in errors if isinstance(error, CheckpointDamagedError)]
    if damaged:
        return damaged[0]
    return CheckpointError(f"cannot load checkpoint {path}: {type(errors[0]).__name__}: {errors[0]}")
