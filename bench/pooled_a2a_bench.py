"""The pooled-embedding all-to-all alone: shm_pooled.py's against TorchRec's, on CPU ranks that
share memory, at the quickstart model's shape (26 tables x dim 64 split between the ranks,
batch 2048 per rank)::

    PYTHONPATH=src torchrun --nproc_per_node=2 bench/pooled_a2a_bench.py
    PYTHONPATH=src torchrun --nproc_per_node=2 bench/pooled_a2a_bench.py --batch_size 4096 --rounds 50

Each round runs the forward (issue and wait) and then the backward of both, in turn, with the
caches first flushed by a pass over 80 MB (as the MLPs' matmuls do between them in a step), and
the ranks lined up by a barrier. Printed per rank: the median forward and backward ms of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

from torchrec_cloud.speedups import shm_group, shm_pooled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=2048, help="per rank")
    parser.add_argument("--dims", type=int, default=26 * 64, help="every rank's pooled dims together")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    pg = shm_group.shared_memory_group()
    if pg is None:
        sys.exit(f"shared memory cannot be used here: {shm_group.why_not}")
    dims = [args.dims // n + (r < args.dims % n) for r in range(n)]
    cpu = torch.device("cpu")
    variants = {
        "shm_pooled": shm_pooled.SharedMemoryPooledAllToAll(shm_group.backend_of(pg), pg, dims, cpu),
        "torchrec": PooledEmbeddingsAllToAll(pg, dims, cpu),
    }
    flush = torch.randn(20 << 20)
    x = torch.randn(args.batch_size * n, dims[rank], requires_grad=True)
    grad = torch.randn(args.batch_size, sum(dims))
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, a2a in variants.items():
            x.grad = None
            flush.mul_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            out = a2a(x).wait()
            t1 = time.perf_counter()
            flush.mul_(1.0)
            dist.barrier()
            t2 = time.perf_counter()
            out.backward(grad)
            times[name].append(((t1 - t0) * 1e3, (time.perf_counter() - t2) * 1e3))
    lines = []
    for name, ts in times.items():
        ts = ts[3:]  # the first rounds map the files
        fwd, bwd = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        lines.append(f"rank {rank} {name:10s} forward {fwd:6.2f} ms  backward {bwd:6.2f} ms  "
                     f"(batch {args.batch_size}/rank, dims {dims})")  # fmt: skip
    sys.stdout.write("\n".join(lines) + "\n")  # one write: the ranks share stdout
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
