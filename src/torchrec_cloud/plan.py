"""``torchrec-cloud plan``: TorchRec's sharding plan for a cluster you have not rented yet.

The model comes from the same presets and flags as ``train``; the cluster from a cloud
profile's instance type, or from its GPU count and memory. TorchRec's planner (the one the
trainer runs at start-up, with the same constraints) runs here, on any machine, on the
model built on the meta device, and says per table where it goes (sharding type, kernel,
ranks), per rank how much GPU and host memory the tables take against what is left for
them, whether it fits, and TorchRec's estimate of the embedding part of a step::

    torchrec-cloud plan --preset criteo-1tb --gpus_per_node 1 --gpu_memory 80 --nodes 1
    torchrec-cloud plan --preset criteo-1tb --cloud aws --instance p4d.24xlarge --nodes 2 --json
    torchrec-cloud plan --preset quickstart --gpus_per_node 0 --procs_per_node 2 --host_memory 64

Exit 0: it fits; 1: it does not (the last line says why, names the largest table and the
smallest node count of that kind that holds the model); 2: bad flags. With ``--json`` the
last line is one JSON object (``fits``, ``world_size``, ``tables``, ``per_rank``,
``hbm_cap_bytes``, ``estimated_step_ms``, ...).

``render`` and ``submit`` plan GPU jobs the same way first (:func:`deploy_plan`): a cluster
that cannot hold the model is refused with the same reason, and the job carries the kernel
choice (``--embedding_kernel``). Memory figures are GiB (2^30 bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from torchrec_cloud import counted
from torchrec_cloud.config import ConfigError, JobConfig, add_config_flags, config_from_args

if TYPE_CHECKING:  # torch and TorchRec load only when a plan is made
    from torchrec_cloud.deploy.profiles import Instance, Profile
    from torchrec_cloud.deploy.spec import DeploySpec

GIB = 2**30
EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 1
# TorchRec's default host memory per rank (planner constants.DDR_CAP), when none is given.
DEFAULT_HOST_GIB_PER_RANK = 128
# The smallest-cluster search stops at this many ranks (planning time grows with them).
MAX_SEARCH_RANKS = 256


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is for: ``nodes`` alike, each with ``gpus_per_node`` GPUs of
    ``gpu_memory_gib`` (0 GPUs: CPU nodes running ``procs_per_node`` ranks)."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 0.0
    host_memory_gib: Optional[float] = None
    """Per node; None: TorchRec's default per rank."""
    procs_per_node: int = 1
    instance: Optional[str] = None
    """The profile's instance type, named in the reasons."""

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.procs_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def compute_device(self) -> str:
        return "cuda" if self.gpus_per_node else "cpu"

    @property
    def hbm_cap_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB) if self.gpus_per_node else 0

    @property
    def host_cap_bytes(self) -> int:
        """Host memory per rank."""
        if self.host_memory_gib is None:
            return DEFAULT_HOST_GIB_PER_RANK * GIB
        return int(self.host_memory_gib * GIB / self.ranks_per_node)

    def with_nodes(self, nodes: int) -> "Cluster":
        return dataclasses.replace(self, nodes=nodes)

    def node_kind(self) -> str:
        """What one node is: ``p4d.24xlarge`` or ``1 GPU of 80 GiB`` or ``2 CPU ranks``."""
        if self.instance:
            return self.instance
        if self.gpus_per_node:
            return f"{self.gpus_per_node} GPU{'s' * (self.gpus_per_node > 1)} of {self.gpu_memory_gib:g} GiB"
        return f"{self.procs_per_node} CPU rank{'s' * (self.procs_per_node > 1)}"

    def describe(self) -> str:
        nodes = f"{self.nodes} node{'s' * (self.nodes > 1)}"
        host = f"{self.host_cap_bytes / GIB:.0f} GiB host memory per rank"
        if self.instance and self.gpus_per_node:
            return f"{nodes} of {self.instance} ({self.gpus_per_node} x {self.gpu_memory_gib:g} GiB GPUs, {host})"
        return f"{nodes} of {self.node_kind()} ({host})"

    def topology(self):
        from torchrec_cloud.distributed import make_topology

        return make_topology(self.world_size, self.ranks_per_node, self.compute_device,
                             self.hbm_cap_bytes or None, self.host_cap_bytes)  # fmt: skip


@dataclass
class PlanReport:
    """What the planner decided for a model on a cluster (or why it could not)."""

    cluster: Cluster
    fits: bool
    batch_size: int
    embedding_kernel: str
    tables: list[dict[str, Any]]
    per_rank: list[dict[str, Any]]
    hbm_for_tables_bytes: int = 0
    host_for_tables_bytes: int = 0
    estimated_step_ms: Optional[float] = None
    planner_seconds: float = 0.0
    reason: Optional[str] = None
    smallest_nodes: Optional[int] = None

    def kernels(self) -> dict[str, int]:
        """Tables per kernel, e.g. ``{"fused": 24, "fused_uvm_caching": 2}``."""
        from torchrec_cloud.distributed import kernel_counts

        return kernel_counts(self.tables)

    def kernel_flag(self) -> str:
        """The ``--embedding_kernel`` that reproduces the plan: its one kernel, or ``auto``
        (the planner on the cluster makes the same per-table choice from the same inputs)."""
        kernels = self.kernels()
        return next(iter(kernels)) if len(kernels) == 1 else "auto"

    def summary(self) -> str:
        """One line: the kernels, the cluster, the estimate (a pod annotation, the last line)."""
        kernels = ", ".join(f"{n} {k}" for k, n in self.kernels().items())
        step = f"; embedding step ~{self.estimated_step_ms:.2f} ms" if self.estimated_step_ms is not None else ""
        return f"{counted(len(self.tables), 'table')}: {kernels} on {counted(self.cluster.world_size, 'rank')}{step}"

    def to_json(self) -> dict[str, Any]:
        c = self.cluster
        return {
            "fits": self.fits,
            "world_size": c.world_size,
            "nodes": c.nodes,
            "gpus_per_node": c.gpus_per_node,
            "compute_device": c.compute_device,
            "instance": c.instance,
            "batch_size": self.batch_size,
            "embedding_kernel": self.embedding_kernel,
            "kernels": self.kernels(),
            "tables": self.tables,
            "per_rank": self.per_rank,
            "hbm_cap_bytes": c.hbm_cap_bytes,
            "host_cap_bytes": c.host_cap_bytes,
            "hbm_for_tables_bytes": self.hbm_for_tables_bytes,
            "host_for_tables_bytes": self.host_for_tables_bytes,
            "estimated_step_ms": self.estimated_step_ms,
            "planner_seconds": round(self.planner_seconds, 3),
            "reason": self.reason,
            "smallest_nodes": self.smallest_nodes,
        }


# -- planning -----------------------------------------------------------------------------


def plan_once(cfg: JobConfig, cluster: Cluster) -> PlanReport:
    """One run of TorchRec's planner, as the trainer runs it, for ``cluster``."""
    import torch
    from torchrec.distributed.model_parallel import get_default_sharders
    from torchrec.distributed.planner.types import PlannerError

    from torchrec_cloud.distributed import embedding_constraints, fuse_optimizer, make_planner, plan_tables
    from torchrec_cloud.model import build_model, table_configs

    # The planner logs warnings about dry runs and hand-made topologies: this is both, on purpose.
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    model = build_model(cfg.model, dense_device=torch.device("meta"))
    tables = table_configs(cfg.model)
    constraints = embedding_constraints(model, cfg.sharding, cluster.compute_device)
    fuse_optimizer(model, cfg)
    planner, capture = make_planner(cluster.topology(), cfg, constraints)
    start = time.perf_counter()
    report = PlanReport(cluster, False, cfg.data.batch_size, cfg.sharding.embedding_kernel, plan_tables(None, tables), [])
    try:
        plan = planner.plan(model, get_default_sharders())
    except PlannerError as e:
        report.planner_seconds = time.perf_counter() - start
        report.reason = str(e)  # replaced by why_not_fits' one line
        _set_room(report, capture)
        return report
    report.planner_seconds = time.perf_counter() - start
    report.fits = True
    report.tables = plan_tables(plan, tables)
    ranks = [{"rank": r, "hbm_bytes": 0, "host_bytes": 0, "step_ms": 0.0} for r in range(cluster.world_size)]
    for option in capture.options:
        for shard in option.shards:
            ranks[shard.rank]["hbm_bytes"] += shard.storage.hbm
            ranks[shard.rank]["host_bytes"] += shard.storage.ddr
            ranks[shard.rank]["step_ms"] += shard.perf.total
    for r in ranks:
        r["step_ms"] = round(r["step_ms"], 4)
    report.per_rank = ranks
    # The planner's own rating of a plan: the slowest rank's sum of its shards' estimates.
    report.estimated_step_ms = round(max(r["step_ms"] for r in ranks), 4)
    _set_room(report, capture)
    return report


def _set_room(report: PlanReport, capture) -> None:
    """What each rank has for the tables once TorchRec reserved its margin, the dense part
    and the inputs (unknown when that reservation alone did not fit)."""
    reserved = capture.reservation.last_reserved_topology
    if reserved is not None:
        report.hbm_for_tables_bytes = max(int(reserved.devices[0].storage.hbm), 0)
        report.host_for_tables_bytes = max(int(reserved.devices[0].storage.ddr), 0)


def plan(cfg: JobConfig, cluster: Cluster) -> PlanReport:
    """The plan for ``cluster``; when it does not fit, the one-line reason, with the smallest
    node count of the same kind that holds the model."""
    report = plan_once(cfg, cluster)
    if report.fits:
        return report
    failure = report.reason or ""
    if report.hbm_for_tables_bytes == 0 and report.host_for_tables_bytes == 0:
        room = (f"each {'GPU' if cluster.gpus_per_node else 'rank'} has no memory left for tables once TorchRec "
                f"reserves its {_reservation_pct()} margin, the dense part and the inputs of a batch of "
                f"{cfg.data.batch_size}: a smaller --batch_size or more memory per "
                f"{'GPU' if cluster.gpus_per_node else 'node'} helps, more nodes do not")  # fmt: skip
        report.reason = f"the model does not fit on {cluster.describe()}: {room}"
        return report
    report.smallest_nodes, searched = smallest_nodes(cfg, cluster)
    report.reason = why_not(cfg, report, failure, searched)
    return report


def _reservation_pct() -> str:
    from torchrec_cloud.distributed import STORAGE_RESERVATION

    return f"{STORAGE_RESERVATION:.0%}"


def table_bytes(rows: int, dim: int) -> int:
    """A float32 table with its row-wise Adagrad state (one float per row)."""
    return rows * dim * 4 + rows * 4


def why_not(cfg: JobConfig, report: PlanReport, failure: str, searched: int) -> str:
    """The one line: the cluster, the largest table, what is left for tables, the way out."""
    cluster = report.cluster
    largest = max(report.tables, key=lambda t: t["rows"] * t["dim"])
    room = f"{report.hbm_for_tables_bytes / GIB:.1f} GiB of GPU memory and " if cluster.gpus_per_node else ""
    room += f"{report.host_for_tables_bytes / GIB:.1f} GiB of host memory"
    total = sum(table_bytes(t["rows"], t["dim"]) for t in report.tables)
    line = (f"the model does not fit on {cluster.describe()}: TorchRec's planner found no placement of its "
            f"{len(report.tables)} tables ({total / GIB:.1f} GiB with their optimizer state; the largest, "
            f"{largest['name']}, {largest['rows']:,} rows x {largest['dim']}, {table_bytes(largest['rows'], largest['dim']) / GIB:.1f} GiB) "
            f"with {room} per rank for tables")  # fmt: skip
    cache = table_bytes(largest["rows"], largest["dim"]) * cfg.sharding.cache_load_factor
    if cluster.gpus_per_node and cfg.sharding.embedding_kernel in ("auto", "fused_uvm_caching") \
            and cache > report.hbm_for_tables_bytes:
        line += (f" (even its cache alone, {cache / GIB:.1f} GiB at --cache_load_factor "
                 f"{cfg.sharding.cache_load_factor:g}, is more than one GPU has)")
    if cluster.gpus_per_node and cfg.sharding.embedding_kernel == "fused":
        line += " (--embedding_kernel fused keeps every table in GPU memory; auto may cache the largest)"
    if report.smallest_nodes is not None:
        line += f"; the smallest cluster that holds it: {report.smallest_nodes} nodes of {cluster.node_kind()}"
    else:
        line += f"; no cluster of up to {searched} nodes of {cluster.node_kind()} holds it"
    if not failure.startswith("Unable to find a plan"):
        line += f" ({failure.strip().splitlines()[0]})"
    return line


def smallest_nodes(cfg: JobConfig, cluster: Cluster) -> tuple[Optional[int], int]:
    """The fewest nodes like ``cluster``'s on which the model fits, and the most searched.
    Starts from a bound no plan can beat (the tables' memory over what the nodes have for
    them), grows by half until one fits, then bisects."""
    limit = max(cluster.nodes + 1, MAX_SEARCH_RANKS // cluster.ranks_per_node)
    fits = {cluster.nodes: False}

    def check(nodes: int) -> bool:
        if nodes not in fits:
            fits[nodes] = plan_once(cfg, cluster.with_nodes(nodes)).fits
        return fits[nodes]

    low = cluster.nodes  # does not fit
    high = max(low + 1, _nodes_bound(cfg, cluster))
    while high <= limit and not check(high):
        low, high = high, max(high + 1, math.ceil(high * 1.5))
    if high > limit:
        if limit > low and check(limit):
            high = limit
        else:
            return None, limit
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if check(mid) else (mid, high)
    return high, limit


def _nodes_bound(cfg: JobConfig, cluster: Cluster) -> int:
    """Nodes below which no plan can fit: the least GPU memory the tables can take (cached
    tables their cache's share, UVM tables none) over what one node has for tables."""
    from torchrec_cloud.distributed import STORAGE_RESERVATION

    if not cluster.gpus_per_node:
        return 1
    share = {"fused": 1.0, "auto": cfg.sharding.cache_load_factor, "fused_uvm_caching": cfg.sharding.cache_load_factor,
             "fused_uvm": 0.0}[cfg.sharding.embedding_kernel]  # fmt: skip
    need = sum(table_bytes(rows, cfg.model.embedding_dim) for rows in cfg.model.table_sizes) * share
    per_node = cluster.gpus_per_node * cluster.hbm_cap_bytes * (1 - STORAGE_RESERVATION)
    return max(1, math.ceil(need / per_node)) if per_node > 0 else 1


# -- the cluster from flags or a profile ----------------------------------------------------


def memory_gib(text: str) -> float:
    """``1152 GiB`` / ``680 GB`` / ``1.5 TiB`` (a profile's instance memory) in GiB."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT])(i?)B\s*", text or "")
    if not m:
        raise ValueError(f"not a memory size like '1152 GiB' or '680 GB': {text!r}")
    value, unit, binary = float(m.group(1)), m.group(2), m.group(3)
    power = "KMGT".index(unit) + 1
    return value * (1024 if binary else 1000) ** power / GIB


def instance_cluster(profile: "Profile", instance: "Instance", nodes: int, gpus_per_node: Optional[int] = None,
                     gpu_memory: Optional[float] = None, host_memory: Optional[float] = None) -> Cluster:  # fmt: skip
    """A cluster of ``nodes`` of a profile's instance type (``gpus_per_node`` of its GPUs)."""
    gpus = instance.gpus if gpus_per_node is None else gpus_per_node
    memory = gpu_memory or instance.gpu_memory_gb
    if gpus and not memory:
        raise ConfigError(
            "gpu_memory", f"profile {profile.name!r} gives no gpu_memory_gb for {instance.name}: pass --gpu_memory GB"
        )
    if host_memory is None and instance.memory:
        try:
            host_memory = memory_gib(instance.memory) * (gpus / instance.gpus if instance.gpus and gpus else 1)
        except ValueError as e:
            raise ConfigError("instance", f"profile {profile.name!r}, {instance.name}: memory {e}") from e
    whole = gpus == instance.gpus
    return Cluster(nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=float(memory or 0), host_memory_gib=host_memory,
                   instance=instance.name if whole else None)  # fmt: skip


def cluster_from_args(ns: argparse.Namespace) -> Cluster:
    if ns.nodes < 1:
        raise ConfigError("nodes", f"must be >= 1, got {ns.nodes}")
    for flag in ("gpu_memory", "host_memory"):
        value = getattr(ns, flag)
        if value is not None and value <= 0:
            raise ConfigError(flag, f"must be > 0 (GiB), got {value}")
    if ns.gpus_per_node is not None and ns.gpus_per_node < 0:
        raise ConfigError("gpus_per_node", f"must be >= 0, got {ns.gpus_per_node}")
    if ns.procs_per_node < 1:
        raise ConfigError("procs_per_node", f"must be >= 1, got {ns.procs_per_node}")
    if ns.cloud or ns.instance:
        from torchrec_cloud.deploy.profiles import load_profile

        profile = load_profile(ns.cloud or "generic")
        instance = profile.instance(ns.instance)
        if instance is None:
            raise ConfigError("instance", f"profile {profile.name!r} has no default instance: pass --instance TYPE")
        if ns.gpus_per_node is not None and instance.gpus and ns.gpus_per_node > instance.gpus:
            raise ConfigError("gpus_per_node", f"{instance.name} has {instance.gpus} GPUs, asked for {ns.gpus_per_node}")
        return instance_cluster(profile, instance, ns.nodes, ns.gpus_per_node, ns.gpu_memory, ns.host_memory)
    if ns.gpus_per_node is None:
        raise ConfigError("gpus_per_node", "give the cluster: --cloud C --instance TYPE, or --gpus_per_node G "
                                           "--gpu_memory GB (0 GPUs: CPU nodes)")  # fmt: skip
    if ns.gpus_per_node and not ns.gpu_memory:
        raise ConfigError("gpu_memory", "needed with --gpus_per_node > 0: each GPU's memory in GiB (e.g. 80)")
    return Cluster(nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, gpu_memory_gib=float(ns.gpu_memory or 0),
                   host_memory_gib=ns.host_memory, procs_per_node=1 if ns.gpus_per_node else ns.procs_per_node)  # fmt: skip


# -- render and submit --------------------------------------------------------------------


def deploy_cluster(spec: "DeploySpec", profile: "Profile", instance: Optional["Instance"]) -> tuple[Optional[Cluster], str]:
    """The cluster a rendered job will run on, or None and why it is not planned. CPU nodes
    are not planned: every table is ``fused`` in host memory there, so a plan would choose
    nothing the job carries, and no profile knows a CPU node's memory."""
    if not spec.plan:
        return None, "--no-plan"
    if spec.gpus_per_node == 0:
        return None, "CPU nodes (every table is fused, in host memory)"
    if instance is not None and (spec.gpu_memory or instance.gpu_memory_gb):
        return instance_cluster(profile, instance, spec.nodes, spec.gpus_per_node, spec.gpu_memory), ""
    if spec.gpu_memory:
        return Cluster(nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, gpu_memory_gib=spec.gpu_memory), ""
    return None, "the GPUs' memory is unknown (pass --gpu_memory GB, or --instance_type of a profile that has it)"


def deploy_plan(spec: "DeploySpec", profile: "Profile", instance: Optional["Instance"],
                trainer_args: list[str]) -> Optional[dict[str, Any]]:  # fmt: skip
    """The plan of a job about to be rendered (``PlanReport.to_json`` with ``kernel_flag``
    and ``summary`` added), or None where it is not planned (:func:`deploy_cluster`). A
    cluster that cannot hold the model raises :class:`~torchrec_cloud.distributed.DoesNotFit`
    with the reason ``plan`` gives. Plans are cached by their inputs, in this process and on
    disk (``TORCHREC_CLOUD_PLAN_CACHE``), so rendering again does not load torch."""
    cluster, _ = deploy_cluster(spec, profile, instance)
    if cluster is None:
        return None
    from torchrec_cloud.config import parse_job_config

    cfg = parse_job_config(list(trainer_args))
    key = json.dumps({"model": dataclasses.asdict(cfg.model), "batch_size": cfg.data.batch_size,
                      "sharding": dataclasses.asdict(cfg.sharding), "cluster": dataclasses.asdict(cluster)},
                     sort_keys=True)  # fmt: skip
    result = _cached_plan(key, cfg, cluster)
    if not result["fits"]:
        from torchrec_cloud.distributed import DoesNotFit

        raise DoesNotFit(result["reason"])
    return result


# Plans made or read by this process, by their inputs.
_plans: dict[str, dict[str, Any]] = {}


def _cached_plan(key: str, cfg: JobConfig, cluster: Cluster) -> dict[str, Any]:
    if key in _plans:
        return _plans[key]
    path = _cache_path(key)
    try:
        result = json.loads(path.read_text()) if path is not None and path.exists() else None
    except (OSError, ValueError):  # unreadable or half-written by a crashed process: plan again
        result = None
    if result is None:
        report = plan(cfg, cluster)
        result = {**report.to_json(), "kernel_flag": report.kernel_flag() if report.fits else None,
                  "summary": report.summary() if report.fits else None}  # fmt: skip
        if path is not None:
            try:  # a cache only: a folder we cannot write costs a plan next time, nothing else
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(result))
                tmp.replace(path)
            except OSError:
                pass
    _plans[key] = result
    return result


def _cache_path(key: str) -> Optional[Path]:
    """``TORCHREC_CLOUD_PLAN_CACHE`` (default ~/.cache/torchrec-cloud/plans; ``0``: none),
    one file per plan, named by a hash of its inputs, the stack's versions and this code."""
    folder = os.environ.get("TORCHREC_CLOUD_PLAN_CACHE", "")
    if folder.strip() == "0":
        return None
    root = Path(folder) if folder.strip() else Path.home() / ".cache" / "torchrec-cloud" / "plans"
    digest = hashlib.sha256((key + _code_version()).encode()).hexdigest()[:24]
    return root / f"{digest}.json"


@lru_cache(maxsize=1)
def _code_version() -> str:
    """What a cached plan depends on beside its inputs: the pinned stack and our planning code."""
    from torchrec_cloud.compat import installed_stack

    parts = [f"{dist}={v}" for dist, v in installed_stack().items()]
    here = Path(__file__).parent
    for name in ("plan.py", "distributed.py", "model.py", "config/sections.py", "config/presets.py"):
        parts.append(hashlib.sha256((here / name).read_bytes()).hexdigest()[:16])
    return ";".join(parts)


# -- CLI -------------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="TorchRec's sharding plan for a cluster: does the model fit, where each table goes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cluster = parser.add_argument_group("cluster", "a profile's instance type, or GPUs and their memory")
    cluster.add_argument("--cloud", help="profile (aws, azure, gcp, generic, or a .yaml path) whose instance to plan for")
    cluster.add_argument("--instance", "--instance_type", dest="instance", metavar="TYPE",
                         help="instance type of the profile (default: the profile's)")
    cluster.add_argument("--nodes", type=int, default=1, help="machines in the job (default: 1)")
    cluster.add_argument("--gpus_per_node", type=int, help="GPUs per node (default: the instance's); 0: CPU nodes")
    cluster.add_argument("--gpu_memory", type=float, metavar="GB",
                         help="memory of each GPU in GiB, e.g. 80 (default: the instance's gpu_memory_gb)")
    cluster.add_argument("--host_memory", type=float, metavar="GB",
                         help=f"host memory per node in GiB (default: the instance's, else TorchRec's "
                              f"{DEFAULT_HOST_GIB_PER_RANK} per rank)")
    cluster.add_argument("--procs_per_node", type=int, default=1, help="CPU nodes: ranks per node (default: 1)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    add_config_flags(parser, shown=_planning_flag)
    parser.epilog = ("Only the flags that change the plan are listed: the model's, the sharding's and\n"
                     "--batch_size. Every other `train` flag is accepted too (a train command's flags can\n"
                     "be pasted) and leaves the plan as it is.")
    parser.set_defaults(func=_main)
    return parser


def _planning_flag(section: str, name: str) -> bool:
    """The config fields the planner reads (:func:`plan_once`): the model, where its tables
    may live, and the batch size, whose inputs it reserves memory for."""
    return section in ("model", "sharding") or (section, name) == ("data", "batch_size")


def _main(ns: argparse.Namespace) -> int:
    from torchrec_cloud.data import with_dataset_features

    cfg = with_dataset_features(config_from_args(ns))  # a schema's dataset names the tables
    cluster = cluster_from_args(ns)
    report = plan(cfg, cluster)
    print(render_text(report))
    if ns.json:
        print(json.dumps(report.to_json()))
    return EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT


def render_text(report: PlanReport) -> str:
    c = report.cluster
    lines = [f"plan: {c.describe()}: world size {c.world_size}, batch {report.batch_size:,} per rank, "
             f"--embedding_kernel {report.embedding_kernel}"]  # fmt: skip
    if not report.fits:
        lines.append(report.reason or "does not fit")
        return "\n".join(lines)
    width = max(len(t["name"]) for t in report.tables)
    kw = max(len(t["compute_kernel"]) for t in report.tables)
    lines.append(f"{'table':<{width}}  {'rows':>12}  {'dim':>4}  {'sharding':<14} {'kernel':<{kw}}  ranks")
    for t in report.tables:
        lines.append(f"{t['name']:<{width}}  {t['rows']:>12,}  {t['dim']:>4}  {t['sharding_type']:<14} "
                     f"{t['compute_kernel']:<{kw}}  {_ranges(t['ranks'], c.world_size)}")  # fmt: skip
    gpu = bool(c.gpus_per_node)
    head = f"{'rank':>4}  " + (f"{'GPU memory: tables / for tables / GPU':<40}" if gpu else "")
    lines.append(head + f"{'host memory: tables / for tables / per rank':<46}embedding ms")
    for r in report.per_rank:
        row = f"{r['rank']:>4}  "
        if gpu:
            row += f"{_gib(r['hbm_bytes'], report.hbm_for_tables_bytes, c.hbm_cap_bytes):<40}"
        row += f"{_gib(r['host_bytes'], report.host_for_tables_bytes, c.host_cap_bytes):<46}{r['step_ms']:.3f}"
        lines.append(row)
    kernels = ", ".join(f"{n} {k}" for k, n in report.kernels().items())
    lines.append(
        f"fits: {kernels}; estimated embedding step {report.estimated_step_ms:.3f} ms at batch {report.batch_size:,} "
        "per rank (TorchRec's estimate of the tables' lookups, updates and all-to-alls on the slowest rank; "
        "not the MLPs, the gradient all-reduce or the data)"
    )
    lines.append(f"planned in {report.planner_seconds:.2f} s")
    return "\n".join(lines)


def _gib(used: int, room: int, cap: int) -> str:
    return f"{used / GIB:.2f} / {room / GIB:.2f} / {cap / GIB:.2f} GiB"


def _ranges(ranks: Optional[list[int]], world_size: int) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5``; None (every rank) -> ``all``."""
    if ranks is None:
        return "all"
    out, start = [], None
    ordered = sorted(set(ranks))
    for i, r in enumerate(ordered):
        if start is None:
            start = r
        if i + 1 == len(ordered) or ordered[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    text = ",".join(out)
    return text if len(ranks) == len(ordered) else f"{text} ({len(ranks)} shards)"


if __name__ == "__main__":
    from torchrec_cloud.cli import main

    sys.exit(main(["plan", *sys.argv[1:]]))
