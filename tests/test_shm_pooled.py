"""The pooled-embedding all-to-all over shared memory (speedups/shm_pooled.py) gives, bitwise, the output
and gradients of TorchRec's own PooledEmbeddingsAllToAll, on 3 real torchrun ranks with uneven
batches and dims (one rank without tables), several in flight, bfloat16, callbacks and no_grad;
and the trainer's sharded model uses it."""

import pytest

from helpers import explain, shm_usable, torchrun

pytestmark = pytest.mark.skipif(not shm_usable(3), reason="needs 768 MiB free in /dev/shm and the C kernels")

SCRIPT = r"""
import sys
import torch, torch.distributed as dist
from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll
from torchrec_cloud.speedups import shm_group, shm_pooled

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, n = dist.get_rank(), dist.get_world_size()
pg = shm_group.shared_memory_group()
group = shm_group.backend_of(pg)
assert group is not None and shm_group.backend_of(dist.GroupMember.WORLD) is None

def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"rank {rank}: {what} differs from TorchRec's"

gen = torch.Generator().manual_seed(rank)
checked = 0
for case, (dims, batches, dtype, callbacks) in enumerate([
    ([5, 0, 9], None, torch.float32, []),                      # rank 1 holds no tables
    ([64, 32, 96], [3, 5, 4], torch.float32, []),              # uneven batches
    ([16, 16, 16], [7, 0, 2], torch.float32, [lambda t: t * 2]),  # a rank with no samples; a callback
    ([8, 24, 16], [4, 4, 4], torch.bfloat16, []),
]):
    ours = shm_pooled.SharedMemoryPooledAllToAll(group, pg, dims, torch.device("cpu"), callbacks)
    theirs = PooledEmbeddingsAllToAll(pg, dims, torch.device("cpu"), callbacks)
    batch = sum(batches) if batches else 6 * n
    results = {}
    for name, a2a in (("ours", ours), ("theirs", theirs)):
        # Five in flight (more than the group's slots), waited for last-first, as the pipeline
        # issues the next batch's before it waits on this one's.
        gen.manual_seed(100 * rank + case)
        xs = [(torch.randn(batch, dims[rank], generator=gen) * 10).to(dtype).requires_grad_() for _ in range(5)]
        pending = [a2a(x, batches) for x in xs]
        outs = [p.wait() for p in reversed(pending)][::-1]
        grads = [torch.randn(o.shape, generator=gen).to(dtype) for o in outs]
        # The gradient's columns as the interaction hands them back: a non-contiguous view.
        torch.autograd.backward([o for o in outs], [g.t().contiguous().t() for g in grads])
        with torch.no_grad():
            evaluated = a2a(xs[0].detach(), batches).wait()
        results[name] = (outs, [x.grad for x in xs], evaluated)
    for i, (a, b) in enumerate(zip(results["ours"][0], results["theirs"][0])):
        same(a.detach(), b.detach(), f"case {case}: output #{i}")
    for i, (a, b) in enumerate(zip(results["ours"][1], results["theirs"][1])):
        same(a, b, f"case {case}: gradient #{i}")
    same(results["ours"][2], results["theirs"][2], f"case {case}: output under no_grad")
    checked += 1

# The trainer's sharded model: its table-wise and column-wise output dists use it.
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.build import build
from torchrec_cloud.distributed import Env

cfg = parse_job_config(["--num_embeddings", "100", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
                        "--over_arch_layer_sizes", "16,1", "--batch_size", "24"])
env = Env(rank, n, rank, n, torch.device("cpu"), "gloo")
dmp = build(cfg, env).dmp
dists = [d for m in dmp.modules() for d in getattr(m, "_output_dists", None) or () if isinstance(d, TwPooledEmbeddingDist)]
assert dists and all(isinstance(d._dist, shm_pooled.SharedMemoryPooledAllToAll) for d in dists), dists
sys.stdout.write(f"OK rank {rank}: {checked} cases, {len(dists)} output dist(s)\n")
dist.destroy_process_group()
"""


def test_pooled_all_to_all_matches_torchrec_bitwise(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    proc = torchrun(3, [str(script)], timeout=300)
    assert proc.returncode == 0, explain(proc)
    for r in range(3):
        assert f"OK rank {r}: 4 cases" in proc.stdout, explain(proc)
