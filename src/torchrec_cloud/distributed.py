"""Process group, device, topology and sharding: everything between a built model and a step.

One process without torchrun gets a world of one (an in-memory store, no ports); under
torchrun the usual ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` environment
is read. The planner is told the real topology: world size, ranks per host, the device
and its memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import warnings
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, get_default_sharders
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError, ShardingOption
from torchrec.distributed.types import CacheParams, ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_cloud import comm, compat
from torchrec_cloud.config import ConfigError, JobConfig, ShardingConfig, TrainConfig
from torchrec_cloud.launch import cpu_count
from torchrec_cloud.optim import embedding_lr
from torchrec_cloud.progress import plural


@dataclasses.dataclass
class Env:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass
class StepGroups:
    """The process groups the training step runs on: TorchRec's all-to-alls, DDP's gradient
    all-reduces. None: the default group (the speed-ups layer may give others)."""

    all_to_all: Optional[dist.ProcessGroup] = None
    data_parallel: Optional[dist.ProcessGroup] = None


def init_distributed(backend: str = "auto", num_threads: int = 0, timeout_s: Optional[int] = None) -> Env:
    """Join (or create) the process group and pick this rank's device and thread count;
    a collective fails after ``timeout_s`` (``--pg_timeout_s``)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--backend nccl needs a CUDA GPU; none is visible (use gloo)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Ranks on one host share its cores: give each its share, never more than all of them.
    cores = cpu_count()
    threads = num_threads or max(1, cores // local_world_size)
    if device.type == "cpu" and local_world_size > cores and local_rank == 0:
        print(f"warning: {local_world_size} ranks on this host share its {plural(cores, 'core')}: each trains on "
              f"less than a core, many times slower than {plural(cores, 'rank')} would (--nproc_per_node={cores})",
              file=sys.stderr, flush=True)  # fmt: skip
    torch.set_num_threads(threads)
    keep_freed_memory()
    if not dist.is_initialized():
        timeout = _pg_timeout(timeout_s)
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(
                backend, timeout=timeout, device_id=device if backend == "nccl" else None
            )
    comm.setup(_pg_timeout(timeout_s))
    return Env(rank, world_size, local_rank, local_world_size, device, backend)


def _pg_timeout(seconds: Optional[int] = None) -> timedelta:
    return timedelta(seconds=seconds if seconds is not None else TrainConfig().pg_timeout_s)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """Keep the step's freed buffers in the process instead of handing them back to the kernel.

    glibc serves each large block (an activation of a step at the bench's batch is several
    MB) from a fresh mmap, or trims the heap top once it is free, so every CPU step
    page-faults its buffers in again. Blocks up to 32 MiB then come from the heap and stay
    mapped, and the step reuses the same ones; the peak RSS stays that of the largest step.
    The ``MALLOC_*_`` environment variables, or another allocator, still take precedence."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def _host_memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def topology(env: Env, gpu_memory_gib: Optional[float] = None) -> Topology:
    """The planner's view of the job: ranks, ranks per host, device kind and memory. With
    ``gpu_memory_gib`` the planner gets at most that much of each GPU (``bench --gpu_memory``:
    tables a large GPU could hold then go to host memory, as on a smaller one)."""
    hbm = torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else None
    if hbm is not None and gpu_memory_gib:
        hbm = min(hbm, int(gpu_memory_gib * 2**30))
    return make_topology(env.world_size, env.local_world_size, env.device.type, hbm,
                         _host_memory_bytes() // env.local_world_size)  # fmt: skip


def make_topology(
    world_size: int, local_world_size: int, compute_device: str, hbm_cap: Optional[int], ddr_cap: int
) -> Topology:
    """TorchRec's Topology with its default bandwidths (``torchrec-cloud plan`` builds the
    same for a cluster it is not running on); ``hbm_cap`` and ``ddr_cap`` per rank."""
    return Topology(
        world_size=world_size,
        compute_device=compute_device,
        local_world_size=local_world_size,
        hbm_cap=hbm_cap if compute_device == "cuda" else None,
        ddr_cap=ddr_cap,
    )


def shard_model(
    model: torch.nn.Module, cfg: JobConfig, env: Env, groups: Optional[StepGroups] = None,
    gpu_memory_gib: Optional[float] = None,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Fuse row-wise Adagrad into the tables' backward, plan with the real topology, shard.
    The step's all-to-alls and DDP's all-reduces run on ``groups`` (the speed-ups layer's),
    or on the default group; ``gpu_memory_gib`` caps each GPU's memory the planner plans for
    (:func:`topology`). A model the cluster cannot hold stops here with
    :class:`DoesNotFit` (one line)."""
    groups = groups or StepGroups()
    constraints = embedding_constraints(model, cfg.sharding, env.device.type)  # a bad kernel fails first
    fuse_optimizer(model, cfg)
    sharders = get_default_sharders()
    planner, _ = make_planner(topology(env, gpu_memory_gib), cfg, constraints)
    # The plan is made on rank 0 and broadcast as a pickled object: our control group (comm).
    try:
        plan = planner.collective_plan(model, sharders, comm.group() or dist.GroupMember.WORLD)
    except PlannerError as e:
        raise DoesNotFit(f"the model does not fit on this job's {plural(env.world_size, 'rank')} ({env.device.type}): "
                         f"{planner_failure(e)}; `torchrec-cloud plan` shows what would hold it") from e
    keep_cache_params_where_cached(plan)
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(groups.all_to_all or dist.GroupMember.WORLD),
        data_parallel_wrapper=_DataParallelAcrossRanks(groups.data_parallel),
        plan=plan,
        sharders=sharders,
        device=env.device,
    )
    return dmp, plan


def fuse_optimizer(model: torch.nn.Module, cfg: JobConfig) -> None:
    """Row-wise Adagrad applied in the tables' backward (the planner sizes its state too)."""
    apply_optimizer_in_backward(
        RowWiseAdagrad,
        model.model.sparse_arch.parameters(),
        {"lr": embedding_lr(cfg.optimizer), "eps": cfg.optimizer.eps},
    )


class DoesNotFit(ConfigError):
    """TorchRec's planner found no placement of the tables on the cluster: no restart helps
    (exit 2, like a refused flag). The message is the whole reason, in one line."""

    def __init__(self, reason: str) -> None:
        ValueError.__init__(self, reason)
        self.flag = "nodes"


def make_planner(
    topo: Topology, cfg: JobConfig, constraints: dict[str, ParameterConstraints]
) -> tuple[EmbeddingShardingPlanner, "PlanCapture"]:
    """TorchRec's planner as ``train`` and ``plan`` both run it, and what it chose (the
    sharding options with their storage and perf estimates, the storage it reserved)."""
    with warnings.catch_warnings():  # its FutureWarning is about dry runs without a dense estimate
        warnings.simplefilter("ignore", FutureWarning)
        capture = PlanCapture(HeuristicalStorageReservation(percentage=STORAGE_RESERVATION))
    planner = EmbeddingShardingPlanner(
        topology=topo,
        batch_size=cfg.data.batch_size,
        enumerator=OrderedEnumerator(topology=topo, batch_size=cfg.data.batch_size, constraints=constraints),
        constraints=constraints,
        storage_reservation=capture.reservation,
        stats=[],  # its stats table goes to a log we silence; `torchrec-cloud plan` prints ours
        callbacks=[capture],
        debug=False,
    )
    return planner, capture


# TorchRec's default: the share of each GPU's memory kept out of the tables' reach (beside
# the dense part's and the inputs' own estimates), a margin for what the estimates miss.
STORAGE_RESERVATION = 0.15


class OrderedEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator with its sharding options in one order in every process.

    It lists a table's sharding types and kernels from a Python set, whose order follows the
    process's string hashing (PYTHONHASHSEED), and the planner keeps the first of equally
    rated plans: two processes could pick different plans for the same model and cluster,
    and ``torchrec-cloud plan`` must pick what the trainer picks.
    """

    def enumerate(self, module: torch.nn.Module, sharders: list) -> list[ShardingOption]:
        options = super().enumerate(module, sharders)
        tables: dict[str, int] = {}
        for option in options:
            tables.setdefault(option.name, len(tables))
        kernels = [k.value for k in EmbeddingComputeKernel]
        return sorted(options, key=lambda o: (tables[o.name], SHARDING_TYPES.index(o.sharding_type)
                                              if o.sharding_type in SHARDING_TYPES else len(SHARDING_TYPES),
                                              kernels.index(o.compute_kernel) if o.compute_kernel in kernels else 0))  # fmt: skip


class PlanCapture:
    """The planner's callback: keeps the chosen sharding options (each shard with its rank,
    storage and perf estimates)."""

    def __init__(self, reservation: HeuristicalStorageReservation) -> None:
        self.reservation = reservation
        self.options: list[ShardingOption] = []

    def __call__(self, options: list[ShardingOption]) -> list[ShardingOption]:
        self.options = options
        return options


def planner_failure(error: PlannerError) -> str:
    """The first line of TorchRec's planner error (the rest is a multi-line list of remedies)."""
    return str(error).strip().splitlines()[0].rstrip(". ")


class _DataParallelAcrossRanks(DefaultDataParallelWrapper):
    """DDP for the dense part, except in a world of one: there it would only add a forward
    wrapper, gradient-bucket copies and an all-reduce with itself to every step. The module
    still moves to the device, as DDP's wrapper does (buffers made on the host, such as the
    interaction's indices, go with it)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self._group = group

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        if env.world_size > 1:
            super().wrap(dmp, ShardingEnv.from_process_group(self._group) if self._group is not None else env, device)
        else:
            compat.wrapped_module(dmp).to(device)


SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
]
# The kernels each --embedding_kernel lets the planner choose from on a GPU.
GPU_KERNELS = {
    "auto": [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM_CACHING.value],
    "fused": [EmbeddingComputeKernel.FUSED.value],
    "fused_uvm_caching": [EmbeddingComputeKernel.FUSED_UVM_CACHING.value],
    "fused_uvm": [EmbeddingComputeKernel.FUSED_UVM.value],
}
CACHED = EmbeddingComputeKernel.FUSED_UVM_CACHING.value


def embedding_constraints(
    model: torch.nn.Module, cfg: ShardingConfig, compute_device: str
) -> dict[str, ParameterConstraints]:
    """Every table model-parallel, with the kernels ``--embedding_kernel`` allows on the device.

    Left alone, the planner makes small tables data-parallel with a dense kernel, which
    bypasses the fused row-wise Adagrad the tables are meant to train with (and on a GPU it
    would also weigh key-value and SSD tables, which we do not offer).
    """
    cfg.check_device(compute_device)
    kernels = GPU_KERNELS[cfg.embedding_kernel] if compute_device == "cuda" else [EmbeddingComputeKernel.FUSED.value]
    cache = None
    if CACHED in kernels:
        cache = CacheParams(load_factor=cfg.cache_load_factor, prefetch_pipeline=cfg.prefetch_pipeline)
    ebc = model.model.sparse_arch.embedding_bag_collection
    return {
        table.name: ParameterConstraints(sharding_types=list(SHARDING_TYPES), compute_kernels=list(kernels),
                                         cache_params=cache)
        for table in ebc.embedding_bag_configs()
    }


def keep_cache_params_where_cached(plan: ShardingPlan) -> None:
    """The cache settings go to fbgemm only for tables that have a cache: the planner copies
    a table's constraints to whatever kernel it chose, and fbgemm's prefetch_pipeline hooks
    have nothing to do on a table in GPU memory."""
    for module_plan in plan.plan.values():
        for ps in module_plan.values():  # type: ignore[union-attr]
            if ps.compute_kernel != CACHED:
                ps.cache_params = None


def uses_prefetch_pipeline(cfg: ShardingConfig, plan: ShardingPlan, device: torch.device) -> bool:
    """``--prefetch_pipeline`` applies: on a GPU, with at least one table cached."""
    return cfg.prefetch_pipeline and device.type == "cuda" and any(
        ps.compute_kernel == CACHED for module_plan in plan.plan.values() for ps in module_plan.values()  # type: ignore[union-attr]
    )


def plan_tables(plan: Optional[ShardingPlan], tables: list) -> list[dict]:
    """Where each table (an ``EmbeddingBagConfig`` of ``model.table_configs``) went, as the
    ``start`` record and ``torchrec-cloud plan --json`` list it: name, rows, dim, sharding
    type, kernel, ranks (None: every rank, or not placed when there is no plan)."""
    placed = {name: ps for module_plan in (plan.plan.values() if plan else ()) for name, ps in module_plan.items()}  # type: ignore[union-attr]
    out = []
    for table in tables:
        ps = placed.get(table.name)
        out.append({
            "name": table.name,
            "rows": table.num_embeddings,
            "dim": table.embedding_dim,
            "sharding_type": ps.sharding_type if ps else None,
            "compute_kernel": ps.compute_kernel if ps else None,
            "ranks": list(ps.ranks) if ps is not None and ps.ranks is not None else None,
        })  # fmt: skip
    return sorted(out, key=lambda t: _natural(t["name"]))


def kernel_counts(tables: list[dict]) -> dict[str, int]:
    """Tables per kernel of :func:`plan_tables`' list, e.g. ``{"fused": 24, "fused_uvm_caching": 2}``."""
    counts: dict[str, int] = {}
    for t in tables:
        if t["compute_kernel"]:
            counts[t["compute_kernel"]] = counts.get(t["compute_kernel"], 0) + 1
    return dict(sorted(counts.items()))


def plan_summary(plan: ShardingPlan, title: str = "sharding plan") -> str:
    """Where the embedding tables went, tables with the same placement (sharding type,
    kernel, ranks) on one line: ``title: t_cat_0..25 (26 tables)  column_wise  fused  ranks 0``
    when they all share one, else ``title:`` and a line per placement."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            ranks = ",".join(str(r) for r in ps.ranks) if ps.ranks is not None else "all"
            groups.setdefault((ps.sharding_type, ps.compute_kernel, ranks), []).append(table)
    rows = sorted(((sorted(tables, key=_natural), *placement) for placement, tables in groups.items()),
                  key=lambda row: _natural(row[0][0]))  # fmt: skip
    spans = [_table_span(tables) for tables, *_ in rows]
    width = max((len(span) for span in spans), default=5)
    kw = max([8] + [len(k) for _, _, k, _ in rows])  # fused_uvm_caching is wider than fused
    lines = [f"{span:<{width}}  {s:<12} {k:<{kw}} ranks {r}" for span, (_, s, k, r) in zip(spans, rows)]
    return f"{title}: {lines[0]}" if len(lines) == 1 else "\n  ".join([f"{title}:", *lines])


def _table_span(tables: list[str]) -> str:
    """``t_cat_0..12 (13 tables)``, ``t_cat_0..3,7,9 (6 tables)``: names sharing a stem, by
    number; other names listed."""
    stems = {t.rstrip("0123456789") for t in tables}
    if len(tables) == 1 or len(stems) > 1 or any(t == t.rstrip("0123456789") for t in tables):
        return ",".join(tables)
    stem = stems.pop()
    numbers = sorted(int(t[len(stem):]) for t in tables)
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ",".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)
    return f"{stem}{text} ({len(tables)} tables)"


def _natural(name: str) -> tuple:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else 0)
