"""One builder of a trainer, shared by ``train`` and ``bench``: the model, the speed-ups layer,
sharding over the ranks, the optimizers, the schedule and TorchRec's training pipeline
(its prefetching one where ``--prefetch_pipeline`` applies: UVM-cached tables on a GPU)::

    env = init_distributed(cfg.train.backend, cfg.train.num_threads, cfg.train.pg_timeout_s)
    trainer = build(cfg, env)                # collective: every rank calls it
    loss, _, _ = trainer.pipeline.progress(batches)
    trainer.scheduler.step()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_cloud import compat, speedups
from torchrec_cloud.config import JobConfig
from torchrec_cloud.distributed import Env, plan_tables, shard_model, uses_prefetch_pipeline
from torchrec_cloud.model import build_model, table_configs
from torchrec_cloud.optim import WarmupPolyDecay, build_optimizer


@dataclass
class Trainer:
    """What a training step needs, built for one rank."""

    dmp: DistributedModelParallel
    plan: ShardingPlan
    optimizer: CombinedOptimizer
    scheduler: WarmupPolyDecay
    pipeline: TrainPipelineSparseDist
    speedups: speedups.Speedups
    collectives: str  # how the step communicates: "shared memory + gloo", "gloo", "nccl"
    tables: list[dict]  # where each table went (distributed.plan_tables), for the start record


def build(cfg: JobConfig, env: Env, gpu_memory_gib: Optional[float] = None) -> Trainer:
    """Build, shard and wrap the model of ``cfg`` for this rank (collective). The private
    names of the stack are checked first (:mod:`torchrec_cloud.compat`). ``gpu_memory_gib``
    caps the GPU memory the planner plans for (``bench --gpu_memory``)."""
    compat.check()  # a core name that moved stops the run here, with its name
    model = build_model(cfg.model, dense_device=env.device)
    layer = speedups.prepare(cfg, env)
    layer.apply_to_model(model)
    dmp, plan = shard_model(model, cfg, env, layer.step_groups, gpu_memory_gib)
    layer.apply_to_sharded(dmp)
    optimizer = build_optimizer(dmp, cfg.optimizer)
    scheduler = WarmupPolyDecay(optimizer, cfg.optimizer)
    prefetch = uses_prefetch_pipeline(cfg.sharding, plan, env.device)
    pipeline_class = PrefetchTrainPipelineSparseDist if prefetch else TrainPipelineSparseDist
    pipeline = pipeline_class(dmp, optimizer, env.device, execute_all_batches=True)
    tables = plan_tables(plan, table_configs(cfg.model))
    return Trainer(dmp, plan, optimizer, scheduler, pipeline, layer, layer.collectives(env), tables)
