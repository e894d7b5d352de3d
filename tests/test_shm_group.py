"""The shared-memory process group (speedups/shm_group.py) gives what gloo gives, on real torchrun ranks:
the same all-to-all bytes and all-reduce sums, also with many collectives in flight; DDP and
training through it end where they end through gloo; a rank that stops answering is named in
an error; where the ranks cannot share files, every rank stays on gloo."""

import glob

import pytest

from helpers import TINY, evals, explain, read_metrics, shm_usable, torchrun

pytestmark = pytest.mark.skipif(not shm_usable(), reason="needs 512 MiB free in /dev/shm and the C kernels")

COLLECTIVES = r"""
import os, sys
import torch, torch.distributed as dist
from torchrec_cloud.speedups import shm_group

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, n = dist.get_rank(), dist.get_world_size()
g = shm_group.shared_memory_group()
assert g is not None and dist.get_backend(g) == shm_group.BACKEND, dist.get_backend(g)
if rank == 0:
    sys.stdout.write(f"RUN {g._run}\n")

def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"rank {rank}: {what} differs from gloo"

def splits(case, rows):
    # rows[r][p]: what rank r sends rank p; known to every rank. Some parts are empty.
    return [[0 if (r + p + case) % 3 == 0 else rows + 3 * r + 5 * p for p in range(n)] for r in range(n)]

gen = torch.Generator().manual_seed(rank)
def data(rows, width, dtype):
    x = torch.randn(rows, width, generator=gen) * 100
    return x.to(dtype)

# All-to-all: sizes that grow the slots and wrap their numbering, empty parts, several
# dtypes and row widths, then equal splits given as [].
count = 0
for case, (rows, width, dtype) in enumerate([
    (1, 1, torch.float32), (7, 3, torch.int64), (3000, 16, torch.bfloat16), (70000, 8, torch.float32),
    (0, 4, torch.float32), (5, 1, torch.uint8), (20000, 13, torch.float16), (2, 64, torch.float32),
]):
    s = splits(case, rows)
    send = [s[rank][p] for p in range(n)]
    recv = [s[p][rank] for p in range(n)]
    x = data(sum(send), width, dtype)
    ref = torch.empty(sum(recv), width, dtype=dtype)
    out = torch.full_like(ref, 7)
    dist.all_to_all_single(ref, x, recv, send)
    dist.all_to_all_single(out, x, recv, send, group=g)
    same(out, ref, f"all_to_all_single case {case}")
    count += 1
x = data(4 * n, 5, torch.float32)
ref, out = torch.empty_like(x), torch.empty_like(x)
dist.all_to_all_single(ref, x)
dist.all_to_all_single(out, x, group=g)
same(out, ref, "all_to_all_single, equal splits")

# Nine in flight (more than the slots), waited for last-first: each still gets its own data.
inputs = [data(100 * (i + 1) * n, 3, torch.float32) for i in range(9)]
outs = [torch.empty_like(t) for t in inputs]
works = [dist.all_to_all_single(o, t, group=g, async_op=True) for o, t in zip(outs, inputs)]
for w in reversed(works):
    w.wait()
for i, (o, t) in enumerate(zip(outs, inputs)):
    ref = torch.empty_like(t)
    dist.all_to_all_single(ref, t)
    same(o, ref, f"all_to_all_single in flight #{i}")

# All-reduce: every op gloo has for these dtypes; ints; one that goes to gloo (BOR).
for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
    for dtype, size in ((torch.float32, 100003), (torch.int64, 17), (torch.bfloat16, 4096)):
        x = data(size, 1, dtype).view(-1)
        ref, out = x.clone(), x.clone()
        dist.all_reduce(ref, op=op)
        dist.all_reduce(out, op=op, group=g)
        same(out, ref, f"all_reduce {op} {dtype}")
        count += 1
bits = torch.tensor([1 << rank, 8], dtype=torch.int64)
dist.all_reduce(bits, op=dist.ReduceOp.BOR, group=g)
assert bits.tolist() == [(1 << n) - 1, 8], bits

# Collectives that stay on gloo underneath.
b = torch.arange(6.0) * (rank + 1)
dist.broadcast(b, src=1, group=g)
same(b, torch.arange(6.0) * 2, "broadcast")
gathered = [torch.empty(2) for _ in range(n)]
dist.all_gather(gathered, torch.full((2,), float(rank)), group=g)
assert [int(t[0]) for t in gathered] == list(range(n))
objs = [None] * n
dist.all_gather_object(objs, {"rank": rank}, group=g)
assert objs == [{"rank": r} for r in range(n)]
dist.barrier(group=g)

# DDP over the group: one SGD step ends with the parameters of DDP over gloo.
from torch.nn.parallel import DistributedDataParallel as DDP
def step(group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(), torch.nn.Linear(300, 1))
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]
for a, b in zip(step(g), step(None)):
    same(a, b, "DDP step")

# A group whose collectives a thread completes (the trainer's DDP group): DDP again, and
# all-reduces in flight, more than the slots, waited for last-first.
bg = shm_group.shared_memory_group(background=True)
for a, b in zip(step(bg), step(None)):
    same(a, b, "DDP step, background group")
xs = [data(1000 * (i + 1), 1, torch.float32).view(-1) for i in range(9)]
refs = [x.clone() for x in xs]
works = [dist.all_reduce(x, group=bg, async_op=True) for x in xs]
for w in reversed(works):
    w.wait()
for i, (x, ref) in enumerate(zip(xs, refs)):
    dist.all_reduce(ref)
    same(x, ref, f"all_reduce in flight #{i}, background group")
sys.stdout.write(f"OK rank {rank}: {count}\n")  # one write: the ranks share stdout
dist.destroy_process_group()
"""


def _two_ranks(tmp_path, source: str, timeout: float = 120):
    """Run source as a script on 2 torchrun ranks; it must exit 0."""
    script = tmp_path / "ranks.py"
    script.write_text(source)
    proc = torchrun(2, [str(script)], timeout=timeout)
    assert proc.returncode == 0, explain(proc)
    return proc


def test_collectives_match_gloo_and_leave_no_files(tmp_path):
    proc = _two_ranks(tmp_path, COLLECTIVES, timeout=300)
    assert "OK rank 0: 20" in proc.stdout and "OK rank 1: 20" in proc.stdout, explain(proc)
    runs = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RUN ")}
    assert len(runs) == 1, proc.stdout
    left = glob.glob(f"/dev/shm/torchrec-cloud-shm-{runs.pop()}-*")
    assert left == [], left


STALLED = r"""
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from torchrec_cloud.speedups import shm_group

dist.init_process_group("gloo")
g = shm_group.shared_memory_group(timeout=timedelta(seconds=2))
if dist.get_rank() == 0:
    x = torch.ones(8)
    try:
        dist.all_to_all_single(torch.empty(8), x, group=g)
    except Exception as e:
        sys.stdout.write(f"ERROR {type(e).__name__} {e}\n")
    else:
        sys.stdout.write("no error\n")
dist.barrier()  # rank 1 never joined the all-to-all
dist.destroy_process_group()
"""


def test_a_rank_that_never_joins_is_named_after_the_timeout(tmp_path):
    proc = _two_ranks(tmp_path, STALLED)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(("ERROR", "no error"))), "")
    assert line.startswith("ERROR SharedMemoryError"), explain(proc)
    assert "rank 1 did not issue" in line and "within 2 s" in line, line


SEPARATE = r"""
import os, sys
import torch.distributed as dist
from torchrec_cloud import speedups
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.distributed import Env
from torchrec_cloud.speedups import shm_group
import torch

dist.init_process_group("gloo")
if os.environ.get("SEPARATE_DIRS"):  # as two containers with their own /dev/shm
    shm_group.SHM_DIR = os.path.join(os.environ["SEPARATE_DIRS"], f"rank{dist.get_rank()}")
    os.makedirs(shm_group.SHM_DIR)
if os.environ.get("SMALL_SHM") == str(dist.get_rank()):  # as Docker's default 64 MiB, on one rank
    shm_group.MIN_FREE_PER_RANK = 1 << 60
env = Env(dist.get_rank(), 2, dist.get_rank(), 2, torch.device("cpu"), "gloo")
layer = speedups.prepare(parse_job_config([]), env)
g = layer.step_groups.all_to_all or dist.GroupMember.WORLD
sys.stdout.write(f"GROUP {dist.get_backend(g)} {layer.not_applied.get('shm_collectives')}\n")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("env, expected, why", [
    ({}, "torchrec_cloud_shm", "None"),
    ({"TORCHREC_CLOUD_SHM": "0"}, "gloo", "--no-shm_collectives"),  # the environment sets the flag's default
    ({"SEPARATE_DIRS": "1"}, "gloo", "cannot open each other's files"),
    ({"SMALL_SHM": "1"}, "gloo", None),  # rank 1 says why; rank 0 that another rank cannot
])  # fmt: skip
def test_every_rank_uses_gloo_where_files_cannot_be_shared(tmp_path, monkeypatch, env, expected, why):
    for k, v in env.items():
        monkeypatch.setenv(k, str(tmp_path) if k == "SEPARATE_DIRS" else v)
    proc = _two_ranks(tmp_path, SEPARATE)
    lines = [line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("GROUP ")]
    assert [group for group, _ in lines] == [expected, expected], explain(proc)
    reasons = sorted(reason for _, reason in lines)
    if why is not None:
        assert all(why in r for r in reasons), reasons
    else:
        assert any("another rank cannot use it" in r for r in reasons), reasons
        assert any("MiB free, less than" in r for r in reasons), reasons


def test_two_rank_training_ends_as_it_does_over_gloo(tmp_path, monkeypatch):
    results = {}
    for shm in ("1", "0"):
        monkeypatch.setenv("TORCHREC_CLOUD_SHM", shm)
        out = tmp_path / f"shm{shm}"
        proc = torchrun(2, ["-m", "torchrec_cloud", "train", *TINY, "--output_dir", str(out)])
        assert proc.returncode == 0, explain(proc)
        records = read_metrics(out)
        results[shm] = [(r["auc"], r["logloss"]) for r in evals(records, "val") + evals(records, "test")]
    assert results["1"] and results["1"] == results["0"], results
