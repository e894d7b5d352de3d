"""Held-out evaluation: AUC, log loss and normalised entropy, identical on every rank.

Each rank scores its share of the split; predictions and labels are gathered from all
ranks and the metrics computed on the whole split, so every rank reports the same
numbers and the result does not depend on how many ranks there are.
"""

from __future__ import annotations

import math
import time

import torch
from torchmetrics.functional.classification import binary_auroc

from torchrec_cloud import comm
from torchrec_cloud.data import DataSource


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, log loss (mean binary cross-entropy) and NE (log loss / entropy of the base rate)."""
    logits, labels = logits.double(), labels.double()
    logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    p = float(labels.mean())
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else float("nan")
    auc = float(binary_auroc(torch.sigmoid(logits).float(), labels.long()))
    return {"auc": auc, "logloss": logloss, "ne": logloss / base, "rows": int(labels.numel())}


@torch.no_grad()
def evaluate(model: torch.nn.Module, source: DataSource, split: str, device: torch.device) -> dict[str, float]:
    """Score ``split`` with ``model`` (a DLRMTrain or a DMP around one) and return metrics."""
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    logits_parts, label_parts = [], []
    for batch, valid in source.eval_batches(split):
        _, (_, logits, labels) = model(batch.to(device))
        logits_parts.append(logits.view(-1)[:valid].float())
        label_parts.append(labels.view(-1)[:valid].float())
    logits = comm.gather_1d(torch.cat(logits_parts))
    labels = comm.gather_1d(torch.cat(label_parts))
    metrics = binary_metrics(logits, labels)
    metrics["seconds"] = time.perf_counter() - start
    model.train(was_training)
    return metrics
