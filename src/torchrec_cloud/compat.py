"""Every private name of TorchRec, fbgemm and torch (and azure-ai-ml) that torchrec-cloud reads,
patches or subclasses, listed once and checked once when a run starts.

An upgrade of the pinned stack (``requirements/stack.txt``) is then one file to audit: run
``pytest tests/test_compat.py``, and for each entry it names, read our code that relies on
it (``where``) against the new version, fix it, and update the entry.

Two kinds of entries:

- the speed-ups layer's (``speedups`` names the speed-ups that rely on it): its modules
  patch and subclass TorchRec and fbgemm directly, and rewrite some of TorchRec's forwards.
  Those forwards are pinned here by a fingerprint of their code (comments, docstrings and
  layout left out), so a TorchRec that changes one is noticed instead of diverging
  silently. Where an entry fails, the speed-ups that rely on it fall back to TorchRec's and
  fbgemm's own path, and the run's ``start`` record says why (``speedups.not_applied``);
- the rest of the code's (``speedups`` empty): it reaches these names only through the
  accessors below. Where one that a run needs fails, the run stops at start-up with a
  :class:`CompatError` naming it. Entries with ``at_start=False`` serve tools and are not
  checked by a run: ``load_full_state`` (checkpoint inspection) checks its own when called;
  azure-ai-ml's, which ``deploy/azureml.py`` still reads directly, only tests/test_compat.py.

::

    compat.check()          # at start-up: raises for the core, {speed-up: why} for the layer
    compat.problems()       # {entry name: what is wrong}, for the entries a run needs
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import inspect
import io
import linecache
import os
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torchrec_cloud.errors import CommandError


class CompatError(CommandError, RuntimeError):
    """A private name of the pinned stack moved or changed: the installed torch, TorchRec or
    fbgemm is not the one ``requirements/stack.txt`` pins (or compat.py needs updating)."""


def installed_stack() -> dict[str, str]:
    """The installed versions of the pinned stack (from package metadata: nothing imported)."""
    from importlib import metadata

    found = {}
    for dist in ("torch", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def _resolve(dotted: str) -> Any:
    """``package.module.Attr.attr`` -> the object (the longest importable module prefix)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def fingerprint(fn: Callable) -> str:
    """A hash of ``fn``'s code as tokens: its comments, docstring, blank lines and indentation
    do not count, so only a change of what it does (or of its names) changes the hash."""
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    lines = source.splitlines(keepends=True)
    first = node.body[0]  # type: ignore[attr-defined]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines[first.lineno - 1 : first.end_lineno] = []
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    tokens = [t.string for t in tokenize.generate_tokens(io.StringIO("".join(lines)).readline) if t.type not in skip]
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Private:
    """One private name (or a group read together) and the check that it is as we use it."""

    name: str
    where: str
    check: Callable[[], None]
    speedups: tuple[str, ...] = ()
    at_start: bool = True


def _has(dotted: str, *attrs: str) -> Callable[[], None]:
    def check() -> None:
        obj = _resolve(dotted)
        missing = [a for a in attrs if not hasattr(obj, a)]
        assert not missing, f"{dotted} has no {', '.join(missing)}"

    return check


def _assigned_in(dotted: str, *attrs: str) -> Callable[[], None]:
    """The attributes are set in that function (an ``__init__``): instance attributes that a
    class cannot show without an instance."""

    def check() -> None:
        source = inspect.getsource(_resolve(dotted))
        missing = [a for a in attrs if f"self.{a}" not in source]
        assert not missing, f"{dotted} no longer sets {', '.join('self.' + a for a in missing)}"

    return check


def _registers(dotted: str, *buffers: str) -> Callable[[], None]:
    """That function registers these buffers (``register_buffer("name", ...)``)."""

    def check() -> None:
        source = inspect.getsource(_resolve(dotted))
        missing = [b for b in buffers if f'"{b}"' not in source]
        assert not missing, f"{dotted} no longer registers {', '.join(missing)}"

    return check


_TBE = "fbgemm_gpu.split_table_batched_embeddings_ops_training.SplitTableBatchedEmbeddingBagsCodegen"


def _pinned(**expected: str) -> Callable[[], None]:
    """Each function's :func:`fingerprint` is what we audited our rewrite against."""

    def check() -> None:
        changed = [f"{name} ({fingerprint(_resolve(name))}, audited {fp})" for name, fp in expected.items()
                   if fingerprint(_resolve(name)) != fp]  # fmt: skip
        assert not changed, "changed since audited: " + "; ".join(changed)

    return check


def _pinned_class(path: str, forward: str, init: str) -> Callable[[], None]:
    """A class whose ``forward`` and ``__init__`` we audited (its attributes are set in the latter)."""
    return _pinned(**{f"{path}.forward": forward, f"{path}.__init__": init})


def _all_of(*checks: Callable[[], None]) -> Callable[[], None]:
    def check() -> None:
        for c in checks:
            c()

    return check


def _fbgemm_args() -> None:
    from fbgemm_gpu.split_embedding_codegen_lookup_invokers import lookup_args

    want = {
        "CommonArgs": ("placeholder_autograd_tensor", "host_weights", "weights_offsets", "D_offsets", "indices",
                       "offsets", "pooling_mode", "indice_weights", "feature_requires_grad", "output_dtype",
                       "vbe_metadata", "learning_rate_tensor"),
        "OptimizerArgs": ("eps", "gradient_clipping", "max_norm", "weight_decay"),
        "Momentum": ("host", "offsets"),
        "VBEMetadata": ("B_offsets",),
    }  # fmt: skip
    for cls, fields in want.items():
        missing = set(fields) - set(getattr(lookup_args, cls)._fields)
        assert not missing, f"fbgemm's lookup_args.{cls} has no {', '.join(sorted(missing))}"


# fbgemm's PoolingMode and SparseType as the ints its invoker hands speedups/rowwise_adagrad.py:
# kept here, beside their check, so that the speed-ups import compat and never the reverse.
POOLING_SUM, POOLING_MEAN = 0, 1
SPARSE_DTYPE_FP32 = 0


def _fbgemm_enums() -> None:
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    assert (PoolingMode.SUM.value, PoolingMode.MEAN.value) == (POOLING_SUM, POOLING_MEAN), "PoolingMode"
    assert SparseType.FP32.as_int() == SPARSE_DTYPE_FP32, "SparseType.FP32"


def _process_group_methods() -> None:
    import torch.distributed as dist

    overridden = ("alltoall_base", "allreduce", "broadcast", "allreduce_coalesced", "reduce", "allgather",
                  "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
                  "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "send",
                  "recv", "recv_anysource", "barrier", "_get_backend_name")  # fmt: skip
    missing = [m for m in overridden if not hasattr(dist.ProcessGroup, m)]
    assert not missing, f"torch.distributed.ProcessGroup has no {', '.join(missing)}"
    assert isinstance(dist.Backend._plugins, dict), "torch.distributed.Backend._plugins"
    assert isinstance(dist._Work, type), "torch.distributed._Work"


def _azure_job() -> None:
    try:
        from azure.ai.ml.entities import Command, CommandJob
    except ImportError:
        return  # the extra is not installed: nothing here uses it
    assert hasattr(Command, "_to_job") and hasattr(CommandJob, "_to_dict"), "Command._to_job / CommandJob._to_dict"


PRIVATE: tuple[Private, ...] = (
    # -- the speed-ups layer (torchrec_cloud/speedups/) -----------------------------------
    Private(
        "torchrec.models.dlrm.DLRM.forward",
        "speedups/arches.py _SparseFirst.forward: DLRM's forward with the tables first",
        _all_of(_pinned(**{"torchrec.models.dlrm.DLRM.forward": "358d0b50ce8b2634"}),
                _has("torchrec.models.dlrm.DLRM_DCN", "forward"), _has("torchrec.models.dlrm.DLRM_Projection", "forward")),
        speedups=("tables_first",),
    ),
    Private(
        "torchrec.models.dlrm.SparseArch (forward, F, D, _sparse_feature_names)",
        "speedups/arches.py FlatSparseArch: the pooled embeddings read as they lie",
        _pinned_class("torchrec.models.dlrm.SparseArch", forward="4ebc8cb13cb0959e", init="e9672b8d7d8a7e20"),
        speedups=("pooled_in_place", "tables_first"),
    ),
    Private(
        "torch.fx._symbolic_trace.is_fx_tracing",
        "speedups/arches.py FlatSparseArch.keyed: no key check while the pipeline traces the model",
        _has("torch.fx._symbolic_trace", "is_fx_tracing"),
        speedups=("pooled_in_place", "tables_first"),
    ),
    Private(
        "torchrec.models.dlrm.InteractionArch (forward, F, triu_indices)",
        "speedups/arches.py DotInteraction: the pairs only, one-product backward, C kernel on CPU",
        _pinned_class("torchrec.models.dlrm.InteractionArch", forward="7721186a5fb67a28", init="72dac2e973ff3fd5"),
        speedups=("dot_interaction",),
    ),
    Private(
        "torchrec.modules.mlp.Perceptron (forward, _linear, _activation_fn)",
        "speedups/arches.py ReLUPerceptron: bias and ReLU in C around torch's matmul",
        _pinned_class("torchrec.modules.mlp.Perceptron", forward="56dcb4b528ed0894", init="e9b48aa2e62255f1"),
        speedups=("bias_relu",),
    ),
    Private(
        "fbgemm_gpu.split_embedding_codegen_lookup_invokers.lookup_rowwise_adagrad.invoke, "
        "the TBE's placeholder_autograd_tensor, ShardedEmbeddingBagCollection._lookups",
        "speedups/rowwise_adagrad.py install: wraps the invoker, routes our TBEs' CPU lookups (the TBEs found by "
        "compat.table_batched_modules, which evaluation.py's compat.cache_rows_not_locked reads too)",
        _all_of(_has("fbgemm_gpu.split_embedding_codegen_lookup_invokers.lookup_rowwise_adagrad", "invoke"),
                _assigned_in("torchrec.distributed.embeddingbag.ShardedEmbeddingBagCollection.__init__", "_lookups"),
                _assigned_in("fbgemm_gpu.split_table_batched_embeddings_ops_training.SplitTableBatchedEmbeddingBagsCodegen.__init__",
                             "placeholder_autograd_tensor")),
        speedups=("rowwise_adagrad",),
    ),
    Private(
        "fbgemm_gpu.split_embedding_codegen_lookup_invokers.lookup_args (CommonArgs, OptimizerArgs, Momentum fields)",
        "speedups/rowwise_adagrad.py _fast_path: the invoker's arguments it reads",
        _fbgemm_args,
        speedups=("rowwise_adagrad",),
    ),
    Private(
        "fbgemm PoolingMode and SparseType as the invoker's ints",
        "speedups/rowwise_adagrad.py _fast_path, _RowwiseAdagradLookup: compat.POOLING_SUM, POOLING_MEAN, SPARSE_DTYPE_FP32",
        _fbgemm_enums,
        speedups=("rowwise_adagrad",),
    ),
    Private(
        "torchrec TwPooledEmbeddingDist (_dist, _pg, _codecs, _dim_sum_per_rank, _device, _callbacks) "
        "and ShardedEmbeddingBagCollection._output_dists",
        "speedups/shm_pooled.py install: swaps the output dist's all-to-all",
        _all_of(
            _pinned(**{"torchrec.distributed.sharding.tw_sharding.TwPooledEmbeddingDist.forward": "0dbfe9fc9d646d91",
                       "torchrec.distributed.sharding.tw_sharding.TwPooledEmbeddingDist._create_output_dist_module": "580dd42b77281496"}),
            _assigned_in("torchrec.distributed.sharding.tw_sharding.TwPooledEmbeddingDist.__init__",
                         "_dist", "_pg", "_codecs", "_dim_sum_per_rank", "_device", "_callbacks"),
            _assigned_in("torchrec.distributed.embeddingbag.ShardedEmbeddingBagCollection.__init__", "_output_dists"),
        ),
        speedups=("shm_collectives",),
    ),
    Private(
        "torchrec PooledEmbeddingsAllToAll (_dim_sum_per_rank, _callbacks) and Awaitable._wait_impl",
        "speedups/shm_pooled.py SharedMemoryPooledAllToAll, _Pending: a subclass of each",
        _all_of(
            _pinned(**{"torchrec.distributed.dist_data.PooledEmbeddingsAllToAll.forward": "111e453060171ebc"}),
            _assigned_in("torchrec.distributed.dist_data.PooledEmbeddingsAllToAll.__init__", "_dim_sum_per_rank", "_callbacks"),
            _has("torchrec.distributed.types.Awaitable", "_wait_impl", "callbacks"),
        ),
        speedups=("shm_collectives",),
    ),
    Private(
        "torch.distributed.ProcessGroup subclassed in Python (_get_backend_name, _allgather_base, "
        "_reduce_scatter_base), torch.distributed._Work, Backend._plugins",
        "speedups/shm_group.py SharedMemoryProcessGroup: the collectives through /dev/shm",
        _process_group_methods,
        speedups=("shm_collectives",),
    ),
    # -- the rest of the code, through the accessors below ---------------------------------
    Private(
        "torchrec DistributedModelParallel._dmp_wrapped_module",
        "distributed.py _DataParallelAcrossRanks.wrap: the module moved to the device without DDP",
        _assigned_in("torchrec.distributed.model_parallel.DistributedModelParallel.__init__", "_dmp_wrapped_module"),
    ),
    Private(
        "torch.distributed.checkpoint._fsspec_filesystem.FileSystem",
        "checkpoint/dcp.py _bind: DCP's reader and writer on bucket URLs through our fsspec client",
        _has("torch.distributed.checkpoint._fsspec_filesystem.FileSystem", "init_path"),
    ),
    Private(
        "torch.distributed.checkpoint FileSystemWriter.fs and FileSystemReader.fs (create_stream, rename)",
        "checkpoint/dcp.py _bind: DCP's file streams hashed as written and verified as read",
        _all_of(_assigned_in("torch.distributed.checkpoint.filesystem._FileSystemWriter.__init__", "fs"),
                _assigned_in("torch.distributed.checkpoint.filesystem.FileSystemReader.__init__", "fs"),
                _has("torch.distributed.checkpoint.filesystem.FileSystem", "create_stream", "rename"),
                _has("torch.distributed.checkpoint._fsspec_filesystem.FileSystem", "create_stream", "rename")),
    ),
    Private(
        "fbgemm SplitTableBatchedEmbeddingBagsCodegen.lock_cache_line, read by _prefetch",
        "evaluation.py evaluate (compat.cache_rows_not_locked): an evaluation's lookups lock no UVM cache row",
        _all_of(_assigned_in(f"{_TBE}.__init__", "lock_cache_line"),
                _pinned(**{f"{_TBE}._prefetch": "a7f00d3071f83611"})),
    ),
    Private(
        "fbgemm SplitTableBatchedEmbeddingBagsCodegen UVM cache counters (gather_uvm_cache_stats, "
        "_init_uvm_cache_stats, get_uvm_cache_stats, reset_uvm_cache_stats, UVMCacheStatsIndex)",
        "bench.py worker_ours (compat.gather_cache_stats, compat.cache_stats): the UVM cache's hit rate",
        _all_of(_assigned_in(f"{_TBE}.__init__", "gather_uvm_cache_stats", "uvm_cache_stats_size"),
                _registers(f"{_TBE}._init_uvm_cache_stats", "uvm_cache_stats", "local_uvm_cache_stats"),
                _has(_TBE, "_init_uvm_cache_stats", "get_uvm_cache_stats", "reset_uvm_cache_stats"),
                _has("fbgemm_gpu.split_table_batched_embeddings_ops_training.UVMCacheStatsIndex",
                     "num_unique_indices", "num_unique_misses", "num_conflict_misses")),
    ),
    Private(
        "torch.distributed._shard.sharded_tensor (Shard, ShardedTensor._init_from_local_shards_and_global_metadata, "
        "ShardedTensor._process_group)",
        "checkpoint/dcp.py private_copy: an asynchronous save's copy of the tables' shards",
        _all_of(_has("torch.distributed._shard.sharded_tensor", "Shard", "ShardedTensor"),
                _has("torch.distributed._shard.sharded_tensor.ShardedTensor", "_init_from_local_shards_and_global_metadata"),
                _assigned_in("torch.distributed._shard.sharded_tensor.ShardedTensor", "_process_group")),
    ),
    Private(
        "torch.distributed.checkpoint.staging.AsyncStager._synchronize_after_execute",
        "checkpoint/checkpointer.py save (compat.already_staged): async save of a copy already made",
        _has("torch.distributed.checkpoint.staging.AsyncStager", "_synchronize_after_execute",
             "should_synchronize_after_execute"),
    ),
    Private(
        "torch.distributed.checkpoint DefaultLoadPlanner.load_bytes (flatten_state_dict, original_state_dict, "
        "mappings, state_dict), _traverse.set_element",
        "checkpoint/dcp.py load_planner (compat.data_only_load_planner): non-tensor entries loaded as data only",
        _all_of(_pinned(**{"torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes": "3e1f1187575e6b10"}),
                _assigned_in("torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.__init__",
                             "flatten_state_dict", "original_state_dict", "mappings"),
                _has("torch.distributed.checkpoint._traverse", "set_element")),
    ),
    Private(
        "torch.distributed.checkpoint FileSystemReader.read_metadata (replaced), StorageMeta.load_id",
        "checkpoint/dcp.py _reader_class: .metadata unpickled with an allowlist and checked, not pickle.load",
        _all_of(_pinned(**{"torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata": "03bb3f8561a7c4b4"}),
                _assigned_in("torch.distributed.checkpoint.filesystem.FileSystemReader.__init__", "load_id", "path")),
    ),
    Private(
        "torch.distributed.checkpoint state_dict_loader._load_state_dict, default_planner._EmptyStateDictLoadPlanner, "
        "_nested_dict.flatten_state_dict",
        "checkpoint/dcp.py load_full_state: a whole checkpoint in one process (checkpoint inspect, tests)",
        _all_of(_has("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
                _has("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
                _has("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")),
        at_start=False,
    ),
    Private(
        "azure.ai.ml Command._to_job, CommandJob._to_dict",
        "deploy/azureml.py dump_job: the job as Azure ML's YAML",
        _azure_job,
        at_start=False,
    ),
)


def _problem(entry: Private) -> Optional[str]:
    try:
        entry.check()
    except Exception as e:  # noqa: BLE001 - an import, attribute or assertion error alike
        return f"{type(e).__name__}: {e}" if not isinstance(e, AssertionError) else str(e)
    return None


@functools.lru_cache(maxsize=None)
def problems() -> dict[str, str]:
    """``{entry name: what is wrong}`` for the entries a run needs that fail here (checked
    once per process; the tools' entries are checked where a tool uses them, so a run does
    not import, say, azure-ai-ml)."""
    found = {e.name: _problem(e) for e in PRIVATE if e.at_start}
    linecache.clearcache()  # the sources the fingerprints read
    return {name: message for name, message in found.items() if message is not None}


UNAUDITED_ENV = "TORCHREC_CLOUD_UNAUDITED_STACK"


def check() -> dict[str, str]:
    """The start-up check: raise :class:`CompatError` naming the first core entry that failed;
    return ``{speed-up: why}`` for the speed-ups whose entries failed (they fall back)."""
    found = problems()
    # A measurement on another stack than the pinned one (a GPU machine that can only take the
    # wheels it has offline, bench/gpu_device_run.sh): names that exist but whose source
    # changed since audited are run as they are, and said so; a missing name still stops it.
    unaudited = os.environ.get(UNAUDITED_ENV) == "1"
    for e in PRIVATE:
        if e.name in found and e.at_start and not e.speedups:
            if unaudited and found[e.name].startswith("changed since audited"):
                print(f"torchrec-cloud: {UNAUDITED_ENV}=1: running {e.name} unaudited ({found[e.name]})",
                      file=sys.stderr, flush=True)  # fmt: skip
                continue
            raise CompatError(f"{e.name} ({e.where}) is not as torchrec-cloud uses it: {found[e.name]}; "
                              "install the stack requirements/stack.txt pins, or update torchrec_cloud/compat.py")  # fmt: skip
    moved: dict[str, str] = {}
    for e in PRIVATE:
        for speedup in e.speedups if e.name in found else ():
            moved.setdefault(speedup, f"{e.name} moved ({found[e.name]})")
    return moved


def _need(name_start: str) -> None:
    """Raise :class:`CompatError` where a tool is about to use an entry that fails."""
    for e in PRIVATE:
        problem = _problem(e) if e.name.startswith(name_start) else None
        if problem is not None:
            raise CompatError(f"{e.name} ({e.where}) is not as torchrec-cloud uses it: {problem}")


# -- accessors: the only way the rest of the code reaches these names -------------------


def wrapped_module(dmp: Any) -> Any:
    """The module inside a DistributedModelParallel (its dense part not yet wrapped in DDP)."""
    return dmp._dmp_wrapped_module


def fsspec_filesystem() -> type:
    """DCP's fsspec ``FileSystem``, to subclass with our storage layer's client."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    return FileSystem


def dcp_file_system(handle: Any) -> Any:
    """The file system a DCP FileSystemWriter or FileSystemReader opens its files through."""
    return handle.fs


def set_dcp_file_system(handle: Any, fs: Any) -> None:
    """Make a DCP FileSystemWriter or FileSystemReader open its files through ``fs`` (which
    has the methods of DCP's ``FileSystem``: create_stream, rename, mkdir, ...)."""
    handle.fs = fs


def sharded_tensor_types() -> tuple[type, type]:
    """``(Shard, ShardedTensor)``."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    return Shard, ShardedTensor


def sharded_tensor_like(original: Any, shards: list) -> Any:
    """A ShardedTensor of ``original``'s global layout and group, holding ``shards`` (its
    local shards' copies)."""
    _, sharded_tensor = sharded_tensor_types()
    return sharded_tensor._init_from_local_shards_and_global_metadata(
        shards, original.metadata(), process_group=original._process_group
    )


def already_staged() -> Any:
    """An AsyncStager for a state dict that is already a private copy: DCP's async save
    writes it as it is, and does not wait for staging after the write starts."""
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


def table_batched_modules(model: Any) -> list:
    """fbgemm's table-batched embedding modules (TBEs) of the sharded collections in ``model``
    (a sharded model, or one TBE). A sharded collection keeps its lookups in a plain list
    (``_lookups``), which ``modules()`` does not walk."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    lookups = [lookup for m in model.modules() for lookup in getattr(m, "_lookups", None) or ()]
    found = {id(m): m for root in (model, *lookups) for m in root.modules()}
    return [m for m in found.values() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]


@contextlib.contextmanager
def cache_rows_not_locked(model: Any) -> Iterator[int]:
    """Within: ``model``'s tables look rows up through their UVM caches without locking the
    cache slots they fill; yields how many of fbgemm's table-batched modules (TBEs) would
    have locked them. Enter it with no training batch in flight (the pipeline drained).

    A TBE built with ``prefetch_pipeline`` (``--prefetch_pipeline``) sets ``lock_cache_line``,
    and every ``_prefetch`` hands it to ``lru_cache_populate``, which raises the lock count of
    the slots the batch uses; only the backward pre-hook of that batch lowers it again
    (fbgemm-gpu 1.8.0 ``split_table_batched_embeddings_ops_training.py``: ``_prefetch``,
    ``_update_cache_counter_and_locations``, ``lxu_cache_locking_counter_decrement``). An
    evaluation's forward has no prefetch before it, so it prefetches inline (``forward``:
    ``if len(self.timesteps_prefetched) == 0``) and has no backward: with the lock on, every
    slot it touched would stay locked for the rest of the evaluation, new ids could not enter
    the cache, and the rest would be read over PCIe. With the lock off, the inline prefetch is
    that of a TBE without the prefetch pipeline: the LRU insert never evicts a slot the batch
    being looked up holds, since those carry the current timestep (fbgemm
    ``src/split_embeddings_cache/lru_cache_populate.cu``, ``lru_cache_insert_kernel``: it
    stops at a slot whose time is ``time_stamp``), which is all a lock buys a forward that has
    no backward; and since nothing locked, nothing is left to unlock."""
    locking = [m for m in table_batched_modules(model) if getattr(m, "lock_cache_line", False)]
    for module in locking:
        module.lock_cache_line = False
    try:
        yield len(locking)
    finally:
        for module in locking:
            module.lock_cache_line = True


def _caching_modules(model: Any) -> list:
    return [m for m in table_batched_modules(model) if m.lxu_cache_weights.numel()]


def gather_cache_stats(model: Any) -> int:
    """Turn on fbgemm's UVM cache counters in every table-batched module of ``model`` that has
    a cache, and zero them; returns how many. fbgemm takes the switch only as a constructor
    argument (``gather_uvm_cache_stats``), which TorchRec does not pass: this sets it and
    runs the method that constructor runs for it (fbgemm-gpu 1.8.0 and 1.6.0
    ``split_table_batched_embeddings_ops_training.py``: ``_init_uvm_cache_stats``, which
    registers the counters as buffers a checkpoint would save: for ``bench``, not training)."""
    modules = _caching_modules(model)
    for module in modules:
        module.gather_uvm_cache_stats = True
        module._init_uvm_cache_stats()
    return len(modules)


def reset_cache_stats(model: Any) -> None:
    """Zero the counters :func:`gather_cache_stats` turned on."""
    for module in _caching_modules(model):
        if module.gather_uvm_cache_stats:
            module.reset_uvm_cache_stats()


def cache_stats(model: Any) -> Optional[dict[str, int]]:
    """fbgemm's UVM cache counters summed over ``model``'s caching modules since they were
    zeroed (``num_calls``, ``num_requested_indices``, ``num_unique_indices``,
    ``num_unique_misses``, ``num_conflict_unique_misses``, ``num_conflict_misses``: per
    prefetch, the ids looked up, the distinct ones, the distinct ones not in the cache, those
    of them the cache could not take, and the lookups then read from host memory), or None
    where no module gathers them."""
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import UVMCacheStatsIndex

    modules = [m for m in _caching_modules(model) if m.gather_uvm_cache_stats]
    if not modules:
        return None
    totals = sum(m.get_uvm_cache_stats().to("cpu", dtype=torch.int64) for m in modules)
    return {index.name: int(totals[index.value]) for index in UVMCacheStatsIndex}


def load_whole(storage_reader: Any, planner: Any) -> dict[str, Any]:
    """A whole DCP checkpoint in this one process, without a process group, as a flat dict
    (what torch's ``dcp_to_torch_save`` does: an empty state dict that ``planner``, from
    :func:`data_only_load_planner` with ``whole``, fills from the checkpoint's own index, where
    the public ``load()`` fills only keys it is given)."""
    _need("torch.distributed.checkpoint state_dict_loader")
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=storage_reader, planner=planner, no_dist=True)
    flat, _ = flatten_state_dict(state)
    return flat


def data_only_load_planner(load_object: Callable[[io.BytesIO, str], Any], whole: bool = False) -> Any:
    """DCP's ``DefaultLoadPlanner`` (``whole``: its ``_EmptyStateDictLoadPlanner``, which builds
    the state dict from the checkpoint's index) whose non-tensor entries load through
    ``load_object(bytes, fqn)``: torch 2.13's ``load_bytes`` loads them with
    ``torch.load(weights_only=False)``, which runs whatever the bytes name. This is that method
    with the loader swapped (pinned: an upgrade that changes it is audited here)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class DataOnlyLoadPlanner(_EmptyStateDictLoadPlanner if whole else DefaultLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = load_object(value, read_item.dest_index.fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return DataOnlyLoadPlanner()
