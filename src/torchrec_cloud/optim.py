"""The optimizers and the learning-rate schedule of a sharded model.

The tables train with fused row-wise Adagrad applied in their backward (set up by
``distributed.shard_model`` at :func:`embedding_lr`); the dense part with Adagrad or SGD;
:class:`WarmupPolyDecay` sets the rate of both every step::

    optimizer = build_optimizer(dmp, cfg.optimizer)
    scheduler = WarmupPolyDecay(optimizer, cfg.optimizer)
    ...; scheduler.step()
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cloud.config import OptimizerConfig


def embedding_lr(cfg: OptimizerConfig) -> float:
    return cfg.embedding_learning_rate if cfg.embedding_learning_rate is not None else cfg.learning_rate


def build_optimizer(dmp: DistributedModelParallel, cfg: OptimizerConfig) -> CombinedOptimizer:
    """The tables' fused optimizer together with Adagrad/SGD over the dense parameters."""
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    on_cpu = next(iter(dense_params.values())).device.type == "cpu"
    if cfg.dense_optimizer == "adagrad":
        # One fused kernel per step on CPU instead of four passes over every parameter.
        kind = {"fused": True} if on_cpu else {"foreach": True}
        make = lambda params: torch.optim.Adagrad(params, lr=cfg.learning_rate, eps=cfg.eps, **kind)  # noqa: E731
    else:
        make = lambda params: torch.optim.SGD(params, lr=cfg.learning_rate, fused=True)  # noqa: E731
    return CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(dense_params, make)])


class WarmupPolyDecay:
    """Linear warm-up to the peak, constant, then polynomial decay to ``lr_end`` x peak.

    Sets ``lr`` on every param group of the combined optimizer; the fused table optimizer
    reads its group's ``lr`` at each ``step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
        self.optimizer = optimizer
        self.cfg = cfg
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.step_count = 0
        self._apply()

    def factor(self, step: int) -> float:
        c = self.cfg
        if c.warmup_steps and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.decay_steps and step >= c.decay_start_step:
            progress = min(1.0, (step - c.decay_start_step) / c.decay_steps)
            return c.lr_end + (1.0 - c.lr_end) * (1.0 - progress) ** c.decay_power
        return 1.0

    def _apply(self) -> None:
        f = self.factor(self.step_count)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * f

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def current_lr(self) -> float:
        return self.base_lrs[-1] * self.factor(self.step_count)

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.base_lrs = list(state["base_lrs"])
        self._apply()
