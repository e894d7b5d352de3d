"""What a checkpoint holds, and torch.distributed.checkpoint (DCP) bound to our storage.

``training_state`` is the state dict DCP saves and loads in place; ``dcp_storage`` gives DCP
a writer or reader for a local folder or a bucket URL (through :mod:`torchrec_cloud.storage`'s
fsspec client); ``private_copy`` and ``already_staged`` let an asynchronous save write a copy
that training cannot change. The private DCP and ShardedTensor names used here come from
:mod:`torchrec_cloud.compat`.
"""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING, Any

from torchrec_cloud import storage
from torchrec_cloud.checkpoint.store import CheckpointError

if TYPE_CHECKING:  # torch loads only where a command needs it: `checkpoint ls` does not
    import torch


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(dmp: torch.nn.Module, optimizer: Any, rank: int, with_rng: bool = True) -> dict[str, Any]:
    """The state dict DCP saves and loads in place.

    ``model``: ``dmp.state_dict()`` has the same keys on any number of ranks (DMP strips
    the DDP ``module.`` prefix of the dense part); tables are ShardedTensors. ``optimizer``:
    the CombinedOptimizer's state by parameter FQN: the fused row-wise Adagrad's
    ``<table>.momentum1`` ShardedTensors (each rank lists its own tables) and the dense
    Adagrad's ``sum``/``step``. RNG states differ per rank, so each has its own key.
    """
    state: dict[str, Any] = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
    if with_rng:
        state["rng"] = {f"rank_{rank}": rng_state()}
    return state


def private_copy(state: Any) -> Any:
    """A copy of the state that training cannot change while a background thread writes it.

    DCP's default stager deep-copies each ShardedTensor. TorchRec's table shards are views
    into one buffer holding all of a rank's tables, and deep-copying a view copies its whole
    buffer: once per table (26 x 650 MB for the quickstart model, 30 s instead of 1).
    Cloning a shard copies only its own rows.
    """
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(state, dict):
        return {key: private_copy(value) for key, value in state.items()}
    if isinstance(state, ShardedTensor):
        local = state.local_shards()
        if local and local[0].tensor.device.type != "cpu":
            return state.to("cpu")  # copies each local shard's rows to host memory
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in local]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, state.metadata(), process_group=state._process_group
        )
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


def already_staged():
    """An AsyncStager for a state dict that is already a private copy (see private_copy)."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class AlreadyStaged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return AlreadyStaged()


def dcp_storage(path: str, write: bool):
    """DCP's file-system writer/reader for a local folder, or bound to the storage layer's
    fsspec client for a bucket URL (one place decides URL options and credentials)."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if write:
        # Object stores publish a file when its upload completes; fsync is for local disks.
        handle = FileSystemWriter(path, sync_files=not storage.is_url(path))
    else:
        handle = FileSystemReader(path)
    if storage.is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

        class StorageFileSystem(FsspecFileSystem):
            def init_path(self, p, **kwargs):
                self.fs, _ = storage.filesystem(str(p))
                return p

        handle.fs = StorageFileSystem()
        handle.path = handle.fs.init_path(path)
    return handle


def read_metadata(path: str):
    """DCP's index of a checkpoint: every saved key with its size, dtype and shards."""
    try:
        return dcp_storage(path, write=False).read_metadata()
    except storage.StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing or damaged .metadata, any backend
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(e).__name__}: {e})") from e


def load_full_state(path: str) -> dict[str, Any]:
    """The whole checkpoint as plain, unsharded tensors in this one process (no process
    group): for inspection, tests and export. Keys are DCP's flattened FQNs."""
    # What torch's dcp_to_torch_save does: an empty state dict that the planner fills from
    # the checkpoint's own index (the public load() fills only keys it is given).
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=dcp_storage(path, write=False), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    flat, _ = flatten_state_dict(state)
    return flat
