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
