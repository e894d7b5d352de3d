"""Every collective torchrec-cloud issues itself, in one place (TorchRec's, DDP's and DCP's
own collectives are theirs).

They carry values that live on the host: each rank's "I have a batch" and "I was
preempted" flags, a loss to average, the evaluation's scores, an error message or the
checkpoint to resume that rank 0 found. They run on a gloo group of their own, made once
by :func:`setup` right after the process group, and every function here hands gloo CPU
tensors (or pickled objects), whatever the training backend is::

    comm.setup(timeout)                 # every rank, after init_process_group
    have, go_on = comm.all_min([1, 1])  # the same answer on every rank
    totals = comm.all_sum(counts)       # exact for integer counts

Why not the default group: on GPUs it is NCCL, which has no CPU backend ("No backend type
associated with device type cpu" for any CPU tensor). Why not the values on the GPU
instead: reading the answer (``.item()``) waits for all GPU work queued before it, so a
per-batch agreement would stop the pipeline's overlap of one batch's input with the
previous batch's compute. Why not a default group of ``cpu:gloo,cuda:nccl``: TorchRec
creates its own sub-groups with the backend name it reads from its group
(``dist.get_backend(pg)`` in its 2D/grid/table-row-wise shardings), so each of those would
carry a gloo backend as well, and a check of ``get_backend(pg) == "nccl"`` anywhere in a
library would quietly take another path. A group of our own leaves the training world
exactly as TorchRec expects it and keeps the control traffic from interleaving with
TorchRec's and DDP's collectives on CPU jobs.

``tests/test_comm.py`` runs every function here under a default group that, like NCCL's,
rejects CPU tensors, and fails if any module issues a collective outside this file (the
CPU speed-ups' shared-memory group excepted).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

_group: Optional[dist.ProcessGroup] = None
_made_for: Any = None  # the default group _group was made beside
_timeout = timedelta(minutes=30)


def setup(timeout: timedelta) -> None:
    """Make the control group, whose collectives fail after ``timeout`` (``--pg_timeout_s``)
    like the training group's (collective: every rank calls it after the default process
    group exists; again only after a new default group). A world of one needs none."""
    global _group, _made_for, _timeout
    world = dist.GroupMember.WORLD
    if _made_for is world:
        return
    _timeout = timeout
    _group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_world_size() > 1 else None
    _made_for = world


def group() -> Optional[dist.ProcessGroup]:
    """The control group, for library calls that take one (the planner's broadcast of its
    plan); None in a world of one."""
    return _group


def _distributed() -> bool:
    if dist.is_initialized() and dist.get_world_size() > 1:
        if _group is None:
            raise RuntimeError("torchrec_cloud.comm.setup() was not called after init_process_group")
        return True
    return False


def all_min(values: Sequence[int]) -> list[int]:
    """The element-wise minimum of ``values`` over all ranks."""
    return all_min_async(values)()


def all_min_async(values: Sequence[int]) -> Callable[[], list[int]]:
    """Start :func:`all_min`; the returned function waits for it and gives the answer.

    Every rank must start the same sequence of these; waiting may come later (the
    training loop agrees on batch k+1 while batch k trains)."""
    flags = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if not _distributed():
        return lambda: flags.tolist()
    work = dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=_group, async_op=True)

    def result() -> list[int]:
        work.wait()
        return flags.tolist()

    return result


def mean(value: torch.Tensor) -> float:
    """The mean over ranks of a float32 scalar (the sum over ranks, divided by their count)."""
    t = value.detach().float().reshape(1).cpu()
    if not _distributed():
        return float(t)
    t = t.clone()
    dist.all_reduce(t, group=_group)
    return float(t / dist.get_world_size())


def max_value(value: float) -> float:
    """The largest ``value`` of any rank."""
    t = torch.tensor([value], dtype=torch.float64)
    if _distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group)
    return float(t)


def gather_1d(t: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D tensor (any length) concatenated in rank order, on the CPU."""
    t = t.detach().cpu()
    if not _distributed():
        return t
    world = dist.get_world_size()
    n = torch.tensor([t.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=_group)
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=t.dtype)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=_group)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks of a tensor (any shape; an integer dtype sums exactly)."""
    t = t.detach().cpu().clone()
    if _distributed():
        dist.all_reduce(t, group=_group)
    return t


def all_to_all_rows(rows: torch.Tensor, send_counts: Sequence[int]) -> torch.Tensor:
    """Rank r's rows ``[sum(send_counts[:r]), sum(send_counts[:r + 1]))`` of ``rows`` (a CPU
    tensor [n, ...]) sent to rank r; returns what every rank sent this one, in rank order.
    Collective: every rank calls it with one count per rank."""
    rows = rows.detach().cpu().contiguous()
    if not _distributed():
        return rows
    world = dist.get_world_size()
    if len(send_counts) != world:
        raise ValueError(f"all_to_all_rows: {len(send_counts)} counts for {world} ranks")
    send = torch.tensor(list(send_counts), dtype=torch.int64)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=_group)
    per_row = math.prod(rows.shape[1:])
    out = torch.empty((int(receive.sum()), *rows.shape[1:]), dtype=rows.dtype)
    dist.all_to_all_single(
        out.view(-1), rows.view(-1),
        output_split_sizes=[int(n) * per_row for n in receive],
        input_split_sizes=[int(n) * per_row for n in send],
        group=_group,
    )  # fmt: skip
    return out


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_group)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_group)
    return box[0]


def barrier() -> None:
    """Wait until every rank is here."""
    if _distributed():
        dist.barrier(group=_group)


def background_group() -> Optional[dist.ProcessGroup]:
    """A further gloo group for collectives issued from a background thread (an asynchronous
    checkpoint's), which on a shared group would interleave with the training thread's in
    a different order on each rank. Collective: every rank calls it."""
    return dist.new_group(backend="gloo", timeout=_timeout)
