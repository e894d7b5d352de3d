"""What a checkpoint holds, and torch.distributed.checkpoint (DCP) bound to our storage.

``training_state`` is the state dict DCP saves and loads in place; ``dcp_storage`` gives DCP
a writer or reader for a local folder or a bucket URL (through :mod:`torchrec_cloud.storage`'s
fsspec client); ``private_copy`` makes a copy that training cannot change, for an
asynchronous save. The private DCP and ShardedTensor names used here come from
:mod:`torchrec_cloud.compat`.
"""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING, Any

from torchrec_cloud import compat, storage
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
        class StorageFileSystem(compat.fsspec_filesystem()):
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
    return compat.load_whole(dcp_storage(path, write=False))
