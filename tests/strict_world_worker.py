"""Run under torchrun by tests/test_comm.py: a default process group that, like NCCL's, has
no backend for CPU tensors, and every collective of ours (comm.py and the code that calls
it: the training loop's agreement and loss, evaluation, the checkpointer's start-up checks)
must still work. Each rank writes what each returned to DIR/rank<r>.json."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def strict_backend(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def main() -> None:
    # Registered for CUDA tensors only: a CPU tensor raises "No backend type associated
    # with device type cpu", NCCL's own error.
    dist.Backend.register_backend("cudaonly", strict_backend, devices=["cuda"])
    dist.init_process_group("cudaonly")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank}
    try:
        dist.all_reduce(torch.ones(1))
        out["world_rejects_cpu"] = False
    except RuntimeError as e:
        out["world_rejects_cpu"] = "No backend type associated with device type cpu" in str(e)

    from torchrec_cloud import comm
    from torchrec_cloud.checkpoint.checkpointer import Checkpointer, _agree
    from torchrec_cloud.preemption import Preemption
    from torchrec_cloud.config import JobConfig
    from torchrec_cloud.distributed import init_distributed
    from torchrec_cloud.train import _Window, agreed_batches

    env = init_distributed("gloo")  # joins the existing strict world; makes the control group
    out["min"] = comm.all_min([rank + 1, 5 - rank])
    out["mean"] = comm.mean(torch.tensor(float(rank + 1)))
    out["max"] = comm.max_value(float(rank * 10))
    out["gathered"] = comm.gather_1d(torch.arange(rank + 2, dtype=torch.float32) + 100 * rank).tolist()
    out["sum"] = comm.all_sum(torch.tensor([rank + 1, 2**40], dtype=torch.int64)).tolist()
    rows = torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * rank  # 3 rows of 2: 1 to rank 0, 2 to rank 1
    out["exchanged"] = comm.all_to_all_rows(rows, [1, 2]).tolist()
    out["objects"] = comm.all_gather_object({"rank": rank})
    out["broadcast"] = comm.broadcast_object(f"from {rank}", src=1)
    comm.barrier()
    out["agreed_from_rank0"] = _agree(env, lambda: f"found by rank {rank}", "checkpoint_path")

    # Rank 1 has 3 batches, rank 0 has 5: both stop after 3, together.
    window = _Window()
    batches = iter(range(5 if rank == 0 else 3))
    out["batches"] = list(agreed_batches(batches, 10, window, Preemption(checkpoints=False)))
    # Rank 0 is preempted: both stop before their first batch.
    preempted = Preemption(checkpoints=False)
    preempted.requested = rank == 0
    out["after_sigterm"] = list(agreed_batches(iter(range(4)), 4, _Window(), preempted))
    out["stopped"] = preempted.stop
    preempted.close()

    # Evaluation's metrics over both ranks' rows, never gathered: scores with many ties,
    # within a rank and across the two.
    from torchmetrics.functional.classification import binary_auroc

    from torchrec_cloud.evaluation import _by_score_range, _score_counts, binary_metrics

    g = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 40, (2, 500), generator=g).double() / 8
    labels = (torch.rand(2, 500, generator=g, dtype=torch.float64) < torch.sigmoid(logits - 2.5)).double()
    across = binary_metrics(logits[rank], labels[rank], across_ranks=True)
    whole = binary_metrics(logits.view(-1), labels.view(-1))
    out["across"], out["whole"] = across, whole
    out["torchmetrics_auc"] = float(binary_auroc(torch.sigmoid(logits.view(-1)), labels.view(-1).long()))
    held, _, _ = _by_score_range(*_score_counts(logits[rank], labels[rank] > 0.5))
    out["held"] = held.tolist()
    out["distinct"] = len(torch.unique(logits))

    window.add(torch.tensor(float(rank + 1)), 8)
    out["train_loss"] = window.record(3, 0, env, 0.1)["loss"]

    cfg = JobConfig()
    cfg.checkpoint.checkpoint_path = os.path.join(sys.argv[1], "ckpt")
    cfg.checkpoint.async_checkpoint = True
    checkpoints = Checkpointer(cfg, env, sink=None)
    out["resume_target"] = checkpoints.resume_target
    out["async_group"] = checkpoints._async_group is not None
    comm.barrier()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
