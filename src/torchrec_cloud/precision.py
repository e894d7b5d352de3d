"""Numeric precision of the dense compute: ``--precision`` of ``train`` and ``bench``."""

from __future__ import annotations

import contextlib
import typing
from typing import Iterator

import torch

from torchrec_cloud.config import Precision

PRECISIONS: tuple[str, ...] = typing.get_args(Precision)


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Set up ``precision`` for the dense compute and return the context to step in.

    ``fp32``: as PyTorch's defaults. ``tf32``: float32 matmuls and convolutions may use
    TF32 (CUDA only; no effect on a CPU). ``bf16``: autocast to bfloat16 around the step,
    so the MLPs run in bfloat16 while the tables, the optimizer state, the dot interaction
    and the loss stay float32.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def float32_scoring(device: torch.device) -> Iterator[None]:
    """Within: float32 compute whatever ``--precision`` set up, for evaluation: autocast off,
    and TF32 off for matmuls and convolutions (``--precision tf32`` turned it on for the
    whole process); the TF32 switches are as they were after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def pins_batches(device: torch.device) -> bool:
    """Whether batches for ``device`` are page-locked, training's and evaluation's alike: on a
    GPU, whose ``non_blocking`` copies are asynchronous only from page-locked memory."""
    return device.type == "cuda"
