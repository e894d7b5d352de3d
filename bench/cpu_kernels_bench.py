"""The CPU step's C kernels alone, against what they replace, at the quickstart model's shape
(26 tables of 100,000 rows x dim 64, batch 2048, the dot interaction over 27 rows)::

    PYTHONPATH=src python bench/cpu_kernels_bench.py
    PYTHONPATH=src python bench/cpu_kernels_bench.py --threads 1 --batch_size 4096 --rounds 30

- the dot interaction, forward and backward: ``cpu_kernels.c`` against the same arithmetic
  in torch ops (speedups.arches.DotInteraction's fallback: bmm of the concatenated rows);
- the tables' pooled lookup: ``speedups.rowwise_adagrad.pooled_lookup`` against fbgemm's CPU
  forward of the same TBE (one id per bag, ids uniform over each table).

Each round flushes the caches with a pass over 80 MB first (as the MLPs' matmuls do between
these in a step), so the inputs come from memory as they do in training. Printed: the median
ms of each over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch

from torchrec_cloud.speedups import arches, native, rowwise_adagrad


def _median_ms(fn: Callable[[], object], rounds: int, flush: torch.Tensor) -> float:
    fn()
    times = []
    for _ in range(rounds):
        flush.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if native.library() is None:
        sys.exit("the C kernels are not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, f, d = args.batch_size, args.tables, args.dim
    flush = torch.zeros(20 << 20)  # 80 MB
    print(f"batch {b}, {f} tables x {args.rows:,} rows x dim {d}, {args.threads} threads; median ms of {args.rounds}")

    arch = arches.InteractionArch(num_sparse_features=f)
    arch.__class__ = arches.DotInteraction
    arch.init_flat_indices()
    dense = torch.randn(b, d, requires_grad=True)
    sparse = torch.randn(b, f, d, requires_grad=True)
    forwards = {
        "C kernel": lambda: arches._NativeDotInteractionFn.apply(dense, sparse, None),
        "torch ops": lambda: arches._DotInteractionFn.apply(dense, sparse, arch.flat_upper, arch.sym_source),
    }
    for name, forward in forwards.items():
        out = forward()
        grad = torch.randn_like(out)
        fwd = _median_ms(forward, args.rounds, flush)
        bwd = _median_ms(lambda: torch.autograd.grad(out, (dense, sparse), grad, retain_graph=True), args.rounds, flush)
        print(f"dot interaction, {name:<10} forward {fwd:6.2f}  backward {bwd:6.2f}")

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [(args.rows, d, EmbeddingLocation.HOST, ComputeDevice.CPU)] * f
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    ids = torch.randint(0, args.rows, (f * b,))
    offsets = torch.arange(f * b + 1)
    weights = tbe.weights_host.view(-1, d)
    row_base = torch.arange(f) * args.rows
    with torch.no_grad():
        ref = tbe(ids, offsets)
    ours = rowwise_adagrad.pooled_lookup(weights, row_base, ids, offsets)
    assert torch.equal(ours, ref), "the C lookup should equal fbgemm's bit for bit"
    with torch.no_grad():
        fb = _median_ms(lambda: tbe(ids, offsets), args.rounds, flush)
    c = _median_ms(lambda: rowwise_adagrad.pooled_lookup(weights, row_base, ids, offsets), args.rounds, flush)
    print(f"pooled lookup,   C kernel   {c:6.2f}  fbgemm's forward {fb:6.2f}")


if __name__ == "__main__":
    main()
