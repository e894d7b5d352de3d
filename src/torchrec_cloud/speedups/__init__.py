"""The speed-ups layer: cheaper versions of TorchRec's modules, fbgemm's CPU update and gloo's
collectives, with the same arithmetic, applied to a model that TorchRec built.

It is applied in two places, after the model is built and after it is sharded, the way
torchtitan applies its converters to a finished model (``build.build`` does this)::

    layer = speedups.prepare(cfg, env)          # what applies here; collective (every rank)
    layer.apply_to_model(model)                 # the built DLRMTrain, before sharding
    dmp, plan = shard_model(model, cfg, env, layer.step_groups)
    layer.apply_to_sharded(dmp)
    layer.record()                              # for the start record: applied, and why not

``--no-speedups`` turns the whole layer off: the run is TorchRec's DLRM as built, fbgemm's
row-wise Adagrad and the process group's own collectives, and learns the same (the
arithmetic is the same; tests/test_speedups.py compares the two). What each speed-up is
(docs/cpu-performance.md says why each helps, bench/RESULTS.md what it measured):

=====================  =======================  =============================================
speed-up               where                    what
=====================  =======================  =============================================
tables_first           any device               DLRM's forward starts the tables' lookup and
                                                all-to-all before the dense MLP (arches.py)
pooled_in_place        any device               the pooled embeddings reach the interaction
                                                as they lie, no split and concatenation
dot_interaction        any device               the dot interaction computes the pairs only;
                                                its backward is one product; C on a CPU
aligned_first_layers   any device               first MLP layers with misaligned inputs pad
                                                them (GPU) or take the interaction's padded
                                                rows (CPU)
bias_relu              CPU                      the MLP layers' bias and ReLU in C
cpu_kernels            CPU                      the C kernels themselves (native.py,
                                                cpu_kernels.c): without them, torch ops
rowwise_adagrad        CPU                      the tables' lookup and row-wise Adagrad for
                                                all tables at once (rowwise_adagrad.py)
shm_collectives        CPU, ranks on one host   all-to-alls and DDP's all-reduces through
                                                /dev/shm (shm_group.py), the pooled
                                                embeddings in their own layout (shm_pooled.py)
=====================  =======================  =============================================

Every private name of TorchRec, fbgemm and torch that these modules touch is listed in
:mod:`torchrec_cloud.compat` and checked once when a run starts; a speed-up whose names
moved falls back to TorchRec's path, and the start record says why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from torchrec_cloud import compat
from torchrec_cloud.config import JobConfig, SpeedupsConfig
from torchrec_cloud.distributed import Env, StepGroups

MODEL_SPEEDUPS = ("tables_first", "pooled_in_place", "dot_interaction", "aligned_first_layers", "bias_relu")
CPU_ONLY = ("bias_relu", "cpu_kernels", "rowwise_adagrad", "shm_collectives")
ALL = (*MODEL_SPEEDUPS, "cpu_kernels", "rowwise_adagrad", "shm_collectives")


@dataclass
class Speedups:
    """What the layer does in this process: the speed-ups it applies and why not the others.

    Made by :func:`prepare` for a run; a test may make one for a model alone
    (``Speedups.for_model(torch.device("cpu")).apply_to_model(model)``).
    """

    on_cpu: bool
    not_applied: dict[str, str] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    step_groups: StepGroups = field(default_factory=StepGroups)
    embedding_update: bool = False  # route the tables' CPU update through rowwise_adagrad.py

    @classmethod
    def for_model(cls, device: torch.device, cfg: Optional[SpeedupsConfig] = None) -> "Speedups":
        """The layer for a model on ``device``, without the parts that need a process group."""
        layer = cls(on_cpu=device.type == "cpu")
        layer._decide(cfg or SpeedupsConfig(), compat.check(), set_kernels=False)
        return layer

    def _decide(self, cfg: SpeedupsConfig, moved: dict[str, str], set_kernels: bool = True) -> None:
        """What does not apply, and why. ``set_kernels``: switch the C kernels on or off for
        this process as ``cfg`` says (a run does; a model alone uses them as they are)."""
        for name in ALL:
            if not cfg.speedups:
                self.not_applied[name] = "--no-speedups"
            elif name in CPU_ONLY and not self.on_cpu:
                self.not_applied[name] = "not on a CPU"
            elif name in moved:
                self.not_applied[name] = moved[name]
                warnings.warn(f"torchrec-cloud: speed-up {name} is off: {moved[name]}", RuntimeWarning, stacklevel=3)
        if "cpu_kernels" not in self.not_applied:
            from torchrec_cloud.speedups import native

            if set_kernels:
                native.set_enabled(cfg.cpu_kernels)
            if set_kernels and not cfg.cpu_kernels:
                self.not_applied["cpu_kernels"] = "--no-cpu_kernels"
            elif native.library() is None:
                self.not_applied["cpu_kernels"] = "no C compiler here (set CC, or install gcc)" if set_kernels else "off"
            else:
                self.applied.append("cpu_kernels")

    def apply_to_model(self, model: torch.nn.Module) -> None:
        """Swap the built (unsharded) DLRMTrain's arches and layers for the cheaper ones of
        :mod:`.arches`, in place; parameters and their names stay as they are."""
        skip = frozenset(name for name in MODEL_SPEEDUPS if name in self.not_applied)
        if len(skip) == len(MODEL_SPEEDUPS):
            return
        from torchrec_cloud.speedups import arches

        self.applied += arches.convert(model.model, on_cpu=self.on_cpu, skip=skip)
        for name in MODEL_SPEEDUPS:
            if name not in self.applied and name not in self.not_applied:
                self.not_applied[name] = "nothing in this model it applies to"

    def apply_to_sharded(self, dmp: torch.nn.Module) -> None:
        """The sharded model's tables update through :mod:`.rowwise_adagrad`, and its pooled
        embeddings travel over the shared-memory group in their own layout (:mod:`.shm_pooled`)."""
        if self.embedding_update:
            from torchrec_cloud.speedups import rowwise_adagrad

            if rowwise_adagrad.install(dmp):
                self.applied.append("rowwise_adagrad")
        if self.step_groups.all_to_all is not None:
            from torchrec_cloud.speedups import shm_pooled

            shm_pooled.install(dmp)  # only the output dists whose group is a shared-memory one
            self.applied.append("shm_collectives")

    def collectives(self, env: Env) -> str:
        """How the step communicates: "shared memory + gloo", "gloo", "nccl"."""
        return "shared memory + gloo" if self.step_groups.all_to_all is not None else env.backend

    def record(self) -> dict[str, Any]:
        """What the start record says: the speed-ups applied, and why not each other one."""
        return {"applied": list(self.applied), "not_applied": dict(self.not_applied)}


def prepare(cfg: JobConfig, env: Env) -> Speedups:
    """The layer for this run: which speed-ups apply on this device and stack, and the
    shared-memory groups for CPU ranks on one host. Collective where it makes those groups:
    every rank calls it."""
    layer = Speedups(on_cpu=env.device.type == "cpu")
    layer._decide(cfg.speedups, compat.check())
    if "rowwise_adagrad" not in layer.not_applied:
        if cfg.optimizer.cpu_embedding_update == "fbgemm":
            layer.not_applied["rowwise_adagrad"] = "--cpu_embedding_update fbgemm"
        else:
            layer.embedding_update = True
    if "shm_collectives" not in layer.not_applied:
        if env.world_size < 2:
            layer.not_applied["shm_collectives"] = "one rank"
        elif not cfg.speedups.shm_collectives:
            layer.not_applied["shm_collectives"] = "--no-shm_collectives"
        else:
            groups, why_not = _shared_memory_groups(timedelta(seconds=cfg.train.pg_timeout_s))
            if groups is None:
                layer.not_applied["shm_collectives"] = why_not
            else:
                layer.step_groups = groups
    return layer


# The shared-memory groups, made once per default process group (they are collective, and
# hold files in /dev/shm): (default group, groups or None, why not).
_made: list[tuple[Any, Optional[StepGroups], str]] = []


def _shared_memory_groups(timeout: timedelta) -> tuple[Optional[StepGroups], str]:
    """Two shared-memory groups over all ranks, or None and why not (collective)."""
    from torchrec_cloud.speedups import shm_group

    world = dist.GroupMember.WORLD
    if not _made or _made[0][0] is not world:
        a2a = shm_group.shared_memory_group(timeout)
        why_not = shm_group.why_not or ""
        # DDP's all-reduces in a group of their own, completed by a thread: DDP then waits for
        # them only at the end of the backward, not at each bucket.
        ddp = shm_group.shared_memory_group(timeout, background=True) if a2a is not None else None
        groups = StepGroups(a2a, ddp) if a2a is not None and ddp is not None else None
        _made[:] = [(world, groups, why_not)]
    return _made[0][1], _made[0][2]
