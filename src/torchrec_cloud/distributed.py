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
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, get_default_sharders
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_cloud import comm, compat
from torchrec_cloud.config import JobConfig, TrainConfig
from torchrec_cloud.optim import embedding_lr


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


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    cores = _cpu_count()
    threads = num_threads or max(1, cores // local_world_size)
    if device.type == "cpu" and local_world_size > cores and local_rank == 0:
        print(f"warning: {local_world_size} ranks on this host share its {cores} core(s): each trains on less "
              f"than a core, many times slower than {cores} rank(s) would (--nproc_per_node={cores})",
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


def topology(env: Env) -> Topology:
    """The planner's view of the job: ranks, ranks per host, device kind and memory."""
    ddr = _host_memory_bytes() // env.local_world_size
    if env.device.type == "cuda":
        hbm = torch.cuda.get_device_properties(env.device).total_memory
        return Topology(
            world_size=env.world_size,
            compute_device="cuda",
            local_world_size=env.local_world_size,
            hbm_cap=hbm,
            ddr_cap=ddr,
        )
    return Topology(
        world_size=env.world_size,
        compute_device="cpu",
        local_world_size=env.local_world_size,
        ddr_cap=ddr,
    )


def shard_model(
    model: torch.nn.Module, cfg: JobConfig, env: Env, groups: Optional[StepGroups] = None
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Fuse row-wise Adagrad into the tables' backward, plan with the real topology, shard.
    The step's all-to-alls and DDP's all-reduces run on ``groups`` (the speed-ups layer's),
    or on the default group."""
    groups = groups or StepGroups()
    apply_optimizer_in_backward(
        RowWiseAdagrad,
        model.model.sparse_arch.parameters(),
        {"lr": embedding_lr(cfg.optimizer), "eps": cfg.optimizer.eps},
    )
    sharders = get_default_sharders()
    planner = EmbeddingShardingPlanner(
        topology=topology(env),
        batch_size=cfg.data.batch_size,
        constraints=fused_constraints(model),
        debug=False,
    )
    # The plan is made on rank 0 and broadcast as a pickled object: our control group (comm).
    plan = planner.collective_plan(model, sharders, comm.group() or dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(groups.all_to_all or dist.GroupMember.WORLD),
        data_parallel_wrapper=_DataParallelAcrossRanks(groups.data_parallel),
        plan=plan,
        sharders=sharders,
        device=env.device,
    )
    return dmp, plan


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


def fused_constraints(model: torch.nn.Module) -> dict[str, ParameterConstraints]:
    """Keep every table model-parallel with the fused kernel.

    Left alone, the planner makes small tables data-parallel with a dense kernel, which
    bypasses the fused row-wise Adagrad the tables are meant to train with.
    """
    sharding_types = [
        ShardingType.TABLE_WISE.value,
        ShardingType.ROW_WISE.value,
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_ROW_WISE.value,
    ]
    ebc = model.model.sparse_arch.embedding_bag_collection
    return {
        table.name: ParameterConstraints(
            sharding_types=sharding_types, compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for table in ebc.embedding_bag_configs()
    }


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
    lines = [f"{span:<{width}}  {s:<12} {k:<8} ranks {r}" for span, (_, s, k, r) in zip(spans, rows)]
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
