"""Held-out evaluation: AUC, log loss and normalised entropy, the same on every rank and on
any number of ranks::

    metrics = evaluate(dmp, optimizer, source, "val", device)               # the whole split
    metrics = evaluate(dmp, optimizer, source, "val", device, rows=131072)  # a fixed sample

Each rank scores its share of the split through TorchRec's ``EvalPipelineSparseDist``, which
copies the next batch to the device and starts its input all-to-all while the current
batch's forward runs (torchrec 1.8.0 ``distributed/train_pipeline/train_pipelines.py``). The
training pipeline must be detached first, and attached again after (``train._evaluate``).

Scores are float32 logits whatever the training step's precision: under bf16 autocast the
last layer's output would be rounded to bf16 (8 bits of mantissa), and the many ties it makes
would lower the AUC; under ``--precision tf32`` a matmul's inputs would be rounded to 10 bits
of mantissa. Autocast and TF32 are off while scoring and TF32 is as it was after
(``precision.float32_scoring``). Float32 scoring is also what an exported model does
(``serving``). Batches are pinned where the training step's are (``precision.pins_batches``),
so the pipeline's ``non_blocking`` copies to the GPU are asynchronous.

Under ``--prefetch_pipeline`` the tables' UVM caches lock the slots a lookup fills until its
batch's backward; an evaluation has none, so its lookups lock nothing
(``compat.cache_rows_not_locked``): no cache row stays locked past its batch, and new ids
keep entering the cache for the whole evaluation.

The metrics are computed without gathering the split anywhere (criteo-1tb's validation
day is ~89M rows). Log loss and the label counts are sums. AUC is exact, by a distributed
sort: each rank sorts its scores and counts positives and negatives per distinct score;
the ranks agree on W - 1 score boundaries (quantiles of a small sample of every rank's
scores) and exchange those counts so that rank r holds the r-th score range, every copy of
a score on one rank; each rank then counts, for its positives, the negatives scored lower
(on its own range and on lower ranks) plus half the ties. The total is an integer sum over
ranks, so the AUC is the same for any number of ranks and equal to the rank-sum (Mann-Whitney)
AUC of the whole split; a rank holds about 1/W of the split's distinct scores. TorchRec's
metric module was not used: its AUC keeps every prediction and all-gathers them to compute
(``torchrec/metrics/auc.py``, ``_state_reduction``), the memory this avoids; a histogram
would bound the error rather than remove it.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from torchrec_cloud import comm, compat
from torchrec_cloud.data import DataSource
from torchrec_cloud.precision import float32_scoring, pins_batches

# Candidates per rank for the score boundaries: enough for even ranges on a few ranks,
# a bounded total (about 64K scores) on many.
_SAMPLE = 65_536


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor, across_ranks: bool = False) -> dict[str, Any]:
    """AUC, log loss (mean binary cross-entropy) and NE (log loss / entropy of the base rate)
    of ``logits`` against 0/1 ``labels``; ``across_ranks``: of every rank's rows together (a
    collective), else of these alone. ``rows``: how many were scored."""
    logits, labels = logits.detach().double().cpu().view(-1), labels.detach().double().cpu().view(-1)
    positive = labels > 0.5
    sums = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum").reshape(1)
    counts = torch.tensor([int(positive.sum()), int((~positive).sum()), int(torch.isnan(logits).sum())])
    values, pos, neg = _score_counts(logits, positive)
    if across_ranks:
        sums, counts = comm.all_sum(sums), comm.all_sum(counts)
        values, pos, neg = _by_score_range(values, pos, neg)
    positives, negatives, nans = (int(c) for c in counts)
    rows = positives + negatives
    logloss = float(sums[0]) / rows if rows else float("nan")
    p = positives / rows if rows else float("nan")
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else float("nan")
    twice_area = torch.tensor([_twice_area(pos, neg, _negatives_below(neg) if across_ranks else 0)])
    if across_ranks:
        twice_area = comm.all_sum(twice_area)
    auc = int(twice_area[0]) / (2 * positives * negatives) if positives and negatives and not nans else float("nan")
    return {"auc": auc, "logloss": logloss, "ne": logloss / base, "rows": rows}


def _score_counts(scores: torch.Tensor, positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ``scores`` in ascending order, with the positives and negatives at each."""
    order = torch.argsort(scores)
    return _merged(scores[order], positive[order].long(), (~positive[order]).long())


def _merged(values: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted ``values`` (ascending) made distinct, their counts added."""
    distinct, inverse = torch.unique_consecutive(values, return_inverse=True)
    out_pos = torch.zeros(len(distinct), dtype=torch.int64).index_add_(0, inverse, pos)
    out_neg = torch.zeros(len(distinct), dtype=torch.int64).index_add_(0, inverse, neg)
    return distinct, out_pos, out_neg


def _twice_area(pos: torch.Tensor, neg: torch.Tensor, negatives_below: int) -> int:
    """Twice the sum over positives of (negatives scored lower + half those scored the
    same): an integer, so sums over ranks are exact. ``negatives_below``: the negatives of
    every lower score range."""
    lower = torch.cumsum(neg, 0) - neg + negatives_below
    return int((pos * (2 * lower + neg)).sum())


def _negatives_below(neg: torch.Tensor) -> int:
    """The negatives held by the ranks below this one (after :func:`_by_score_range`)."""
    totals = comm.gather_1d(neg.sum().reshape(1))
    return int(totals[: dist.get_rank()].sum())


def _by_score_range(values: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's (score, positives, negatives), exchanged so that this rank holds the
    distinct scores of its own range (rank order is score order) with their counts summed
    over ranks. Collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return values, pos, neg
    # Boundaries: quantiles (by rows) of every rank's scores, pooled.
    rows = pos + neg
    k = max(1, _SAMPLE // world)
    if len(values):
        cumulative = torch.cumsum(rows, 0)
        targets = (torch.arange(k, dtype=torch.float64) + 0.5) * float(cumulative[-1]) / k
        picked = values[torch.searchsorted(cumulative.double(), targets).clamp(max=len(values) - 1)]
    else:
        picked = values.new_zeros(0)
    pooled, _ = torch.sort(comm.gather_1d(picked))
    if len(pooled) == 0:  # no rows anywhere
        return values, pos, neg
    boundaries = pooled[[len(pooled) * j // world for j in range(1, world)]]
    # Equal scores get equal ranges, so ties never straddle two ranks.
    owner = torch.bucketize(values, boundaries, right=True)
    sent = torch.bincount(owner, minlength=world).tolist()
    got = comm.all_to_all_rows(torch.stack([values, pos.double(), neg.double()], dim=1), sent)
    order = torch.argsort(got[:, 0])
    got = got[order]
    # Counts travel as float64: exact below 2**53 rows.
    return _merged(got[:, 0].contiguous(), got[:, 1].long(), got[:, 2].long())


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    optimizer: Any,
    source: DataSource,
    split: str,
    device: torch.device,
    rows: Optional[int] = None,
    pin: Optional[bool] = None,
) -> dict[str, Any]:
    """Score ``split`` (or a sample of ``rows`` of its rows: ``DataSource.eval_batches``)
    with ``model`` (a DMP around a DLRMTrain, detached from its training pipeline, none of
    its batches in flight) and return its metrics, ``seconds`` and ``split_rows`` (the whole
    split's). ``pin``: page-lock each batch (default: where training does,
    ``precision.pins_batches``). Collective."""
    from torchrec.distributed.train_pipeline import EvalPipelineSparseDist

    was_training = model.training
    model.eval()
    start = time.perf_counter()
    valid: collections.deque[int] = collections.deque()
    pin = pins_batches(device) if pin is None else pin

    def batches() -> Iterator[Any]:  # read by the pipeline's loading thread
        for batch, n in source.eval_batches(split, rows):
            valid.append(n)  # read in order: the pipeline returns outputs in batch order
            yield batch.pin_memory() if pin else batch

    pipeline = EvalPipelineSparseDist(model, optimizer, device)  # the optimizer is never stepped
    logits_parts, label_parts = [], []
    it = batches()
    try:
        with float32_scoring(device), compat.cache_rows_not_locked(model):
            while True:
                try:
                    _, logits, labels = pipeline.progress(it)
                except StopIteration:
                    break
                n = valid.popleft()
                logits_parts.append(logits.view(-1)[:n].float())
                label_parts.append(labels.view(-1)[:n].float())
    finally:
        pipeline.reset()  # stops its batch-loading thread
        pipeline.detach()  # the model's own forwards back
        model.train(was_training)
    # One copy to the host, after every batch was scored (a copy per batch would wait for each).
    logits = torch.cat(logits_parts).cpu() if logits_parts else torch.zeros(0)
    labels = torch.cat(label_parts).cpu() if label_parts else torch.zeros(0)
    metrics = binary_metrics(logits, labels, across_ranks=True)
    metrics["seconds"] = time.perf_counter() - start
    metrics["split_rows"] = source.num_eval_rows(split)
    return metrics
