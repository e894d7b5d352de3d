"""Throughput benchmark: our trainer against a hand-written PyTorch DLRM and the machine's bound.

    torchrec-cloud bench                  # quickstart model, batch 2048
    torchrec-cloud bench --json           # last line: one JSON object with every figure

Each measurement runs in its own process (so peak RSS is its own), on pre-generated
batches (so data generation is not measured):

- ``ours``: the trainer's own model, sharding, fused optimizer and TrainPipelineSparseDist,
  at 1 rank and at 2 ranks under torchrun (threads split between the ranks as training does).
- ``handwritten``: plain PyTorch, one fused ``nn.EmbeddingBag(sparse=True)`` for all tables,
  the same MLPs and dot interaction, Adagrad.
- ``bound``: FLOPs per training sample (forward + backward, counted by torch's
  FlopCounterMode) divided by the float32 matmul rate measured here.

A shared cloud machine's speed drifts by tens of percent within a minute, so ``ours`` on
1 rank is measured twice (bound, ours, ours on 2 ranks, ours, bound) and the ratios use the
means; the single measurements are in the JSON too. The bound's matmul rate is measured just
before each 1-rank run's warm-up and just after its timed steps (1.5 s each, in a child
process on as many threads), so ours and the bound are compared at the same moment; the
bound runs' own rates, ~1 minute away, are reported beside it (``matmul_gflops_start`` and
``_end``).

On a GPU machine, measure one worker at a time (``--worker``; ``--backend auto`` picks NCCL
there), with the dense matmuls in float32, TF32 or bfloat16 autocast, and optionally a profile::

    torchrec-cloud bench --worker ours --steps 50 --warmup 10 --precision bf16 \\
        --profile prof.txt -- --preset quickstart --synthetic random --batch_size 65536

UVM-cached tables on a GPU that could hold them all: ``--gpu_memory GB`` plans for a smaller
GPU; ids with a skew (``--synthetic planted``) and enough warm-up steps to fill the cache
make the hit rate (``uvm_cache_hit_rate``, beside samples/s) that of a warm cache::

    torchrec-cloud bench --worker ours --steps 30 --warmup 150 --precision bf16 --gpu_memory 79 \\
        -- --preset criteo-1tb --synthetic planted --batch_size 65536
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Callable

import torch

from torchrec_cloud.precision import PRECISIONS, precision_context
from torchrec_cloud.ports import free_port

QUICKSTART_ARGS = ["--preset", "quickstart", "--synthetic", "random", "--no-progress", "--no-tensorboard"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _batches(cfg, rank: int, world_size: int, count: int) -> list:
    from torchrec_cloud.data.synthetic import SyntheticSource

    source = SyntheticSource(cfg, rank, world_size)
    return [source.make_batch("train", i * world_size + rank) for i in range(count)]


def _gpu_busy_ms(prof) -> tuple[float, float]:
    """(union of GPU activity intervals, sum of kernel and copy times) in ms."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e3, sum(b - a for a, b in spans) / 1e3


def _profile_summary(prof, rows: int = 30) -> str:
    on_gpu = any(getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA for e in prof.events())
    sections = [("self_cpu_time_total", "host (self CPU time)")]
    out = []
    if on_gpu:
        sections.insert(0, ("self_device_time_total", "device (self CUDA time)"))
        busy, total = _gpu_busy_ms(prof)
        out.append(f"GPU busy (union of kernels and copies): {busy:.2f} ms; sum of their times: {total:.2f} ms")
    for key, title in sections:
        out.append(f"== top ops by {title} ==")
        out.append(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))
    return "\n".join(out)


# -- workers (each in its own process) ---------------------------------------------------


def cache_hit_rate(stats: dict[str, int] | None) -> float | None:
    """The share of the distinct ids of each batch that a UVM cache already held, from
    fbgemm's counters (:func:`torchrec_cloud.compat.cache_stats`): the rows that did not cross
    PCIe. fbgemm counts misses per distinct id, so this is the figure its counters give."""
    if not stats or not stats["num_unique_indices"]:
        return None
    return 1.0 - stats["num_unique_misses"] / stats["num_unique_indices"]


def worker_ours(cfg, steps: int, warmup: int, precision: str = "fp32", profile: str | None = None,
                gpu_memory: float | None = None) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist

    from torchrec_cloud import comm, compat
    from torchrec_cloud.build import build
    from torchrec_cloud.distributed import init_distributed, kernel_counts
    from torchrec_cloud.progress import quiet_library_warnings

    quiet_library_warnings()
    env = init_distributed(cfg.train.backend, cfg.train.num_threads, cfg.train.pg_timeout_s)
    torch.manual_seed(env.rank)
    trainer = build(cfg, env, gpu_memory)
    pipeline = trainer.pipeline  # the schedule is not stepped: the rate stays at its first step's
    profile_steps = 5 if profile else 0
    # A batch of its own for every step, as training reads them: the ids of a few batches
    # cycled would all sit in a UVM-cached table's cache, and its figures would be a cache's
    # that never misses. Made before the clock starts; a few more than are stepped, so the
    # pipeline's look-ahead never runs dry.
    batches = _batches(cfg, env.rank, env.world_size, warmup + steps + profile_steps + 4)
    on_gpu = env.device.type == "cuda"
    if on_gpu:  # as a DataLoader with pin_memory=True hands them over: copies overlap compute
        batches = [b.pin_memory() for b in batches]
    step_context = precision_context(precision, env.device)
    # UVM-cached tables: fbgemm's cache counters, zeroed after the warm-up steps (which fill
    # the cache), so the hit rate is that of the timed steps.
    cached = compat.gather_cache_stats(trainer.dmp) if on_gpu else 0
    drawn = len(batches)
    it = iter(batches)

    def run(n: int) -> None:
        with step_context:
            for _ in range(n):
                pipeline.progress(it)
        if on_gpu:
            torch.cuda.synchronize()

    # One CPU rank: the matmul rate just before the warm-up and just after the timed steps,
    # so the bound that this run is compared with is the machine's speed at the same moment.
    # Measured by a child process on as many threads, so this one's peak RSS stays its own.
    alongside = not on_gpu and env.world_size == 1
    matmul_before = _matmul_gflops_in_child(torch.get_num_threads()) if alongside else None
    run(warmup)
    if cached:
        compat.reset_cache_stats(trainer.dmp)
    comm.barrier()
    start = time.perf_counter()
    run(steps)
    seconds = time.perf_counter() - start
    done = steps
    cache_stats = compat.cache_stats(trainer.dmp) if cached else None
    if profile:
        header = f"{profile_steps} steps, batch {cfg.data.batch_size}, precision {precision}: " \
                 f"{seconds / steps * 1e3:.2f} ms/step timed without the profiler"  # fmt: skip
        _profile(run, profile_steps, profile, header, on_gpu, write=env.rank == 0)
    matmul_after = _matmul_gflops_in_child(torch.get_num_threads()) if alongside else None
    rss = comm.max_value(_peak_rss_mb())
    result = {
        "samples_per_s": done * cfg.data.batch_size * env.world_size / seconds,
        "peak_rss_mb": rss,
        "world_size": env.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(env.device) if on_gpu else "cpu",
        "batch_size": cfg.data.batch_size,
        "precision": precision,
        "ms_per_step": seconds / steps * 1e3,
        "batches": drawn,  # distinct batches, one per step
        "collectives": trainer.collectives,
        "pipeline": type(trainer.pipeline).__name__,
        "kernels": kernel_counts(trainer.tables),
    }
    if alongside:
        result["matmul_gflops_around"] = [matmul_before, matmul_after]
    if not on_gpu:
        result["cpu_kernels"] = "native" if "cpu_kernels" in trainer.speedups.applied else "torch ops"
    if on_gpu:
        result["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(env.device) / 2**30
        result["gpu_memory_gib"] = torch.cuda.get_device_properties(env.device).total_memory / 2**30
        # The planner's budget where --gpu_memory capped it (None: the whole GPU).
        result["planner_gpu_memory_gib"] = gpu_memory
        result["uvm_cache_hit_rate"] = cache_hit_rate(cache_stats)
        result["uvm_cache_stats"] = cache_stats
    comm.barrier()
    dist.destroy_process_group()
    return result if env.rank == 0 else {}


def _profile(run: Callable[[int], None], steps: int, path: str, header: str, on_gpu: bool, write: bool) -> None:
    """``run(steps)`` under torch's profiler; where ``write``, the top ops to ``path`` (after
    ``header`` and the time under the profiler) and a Chrome trace to ``path.trace.json``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run(steps)
        profiled = time.perf_counter() - t0
    if write:
        with open(path, "w") as f:
            f.write(f"{header}, {profiled * 1e3:.2f} ms for all {steps} under it\n")
            f.write(_profile_summary(prof) + "\n")
        prof.export_chrome_trace(path + ".trace.json")


class HandwrittenDLRM(torch.nn.Module):
    """DLRM in plain PyTorch: one EmbeddingBag for all tables (offset ids), dot interaction."""

    def __init__(self, cfg) -> None:
        super().__init__()
        m = cfg.model
        sizes = m.table_sizes
        self.register_buffer("offsets", torch.tensor([0] + sizes[:-1]).cumsum(0))
        self.emb = torch.nn.EmbeddingBag(sum(sizes), m.embedding_dim, mode="sum", sparse=True)
        self.bottom = _mlp([m.num_dense_features] + m.dense_arch_layer_sizes)
        f = m.num_sparse_features + 1
        self.register_buffer("triu", torch.triu_indices(f, f, offset=1))
        self.top = _mlp([m.embedding_dim + f * (f - 1) // 2] + m.over_arch_layer_sizes, last_relu=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        b, nf = ids.shape
        emb = self.emb((ids + self.offsets).view(-1, 1)).view(b, nf, -1)
        x = self.bottom(dense)
        feats = torch.cat([x.unsqueeze(1), emb], dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.triu[0], self.triu[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def _mlp(sizes: list[int], last_relu: bool = True) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def worker_handwritten(cfg, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = HandwrittenDLRM(cfg)
    dense_opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if not n.startswith("emb.")], lr=0.05)
    sparse_opt = torch.optim.Adagrad(model.emb.parameters(), lr=0.05)
    batches = []
    for batch in _batches(cfg, 0, 1, 16):
        ids = batch.sparse_features.values().view(cfg.model.num_sparse_features, -1).t().contiguous()
        batches.append((batch.dense_features, ids, batch.labels))
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step(i: int) -> None:
        dense, ids, labels = batches[i % len(batches)]
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        loss_fn(model(dense, ids), labels).backward()
        dense_opt.step()
        sparse_opt.step()

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    seconds = time.perf_counter() - start
    return {
        "samples_per_s": steps * cfg.data.batch_size / seconds,
        "peak_rss_mb": _peak_rss_mb(),
        "threads_per_rank": torch.get_num_threads(),
    }


def _matmul_flops_per_s(seconds: float) -> float:
    """The float32 rate of 2048x2048 matmuls on this process's threads, over ``seconds``."""
    n = 2048
    x, y = torch.rand(n, n), torch.rand(n, n)
    for _ in range(3):
        x @ y
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x @ y
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _matmul_gflops_in_child(threads: int, seconds: float = 1.5) -> float:
    code = (f"import torch; torch.set_num_threads({threads}); "
            f"from torchrec_cloud.bench import _matmul_flops_per_s; print(_matmul_flops_per_s({seconds}) / 1e9)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench: measuring the matmul rate failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return float(proc.stdout.split()[-1])


def worker_bound(cfg) -> dict[str, Any]:
    """FLOPs per sample of the dense compute, and the float32 matmul rate of this machine."""
    from torch.utils.flop_counter import FlopCounterMode

    model = HandwrittenDLRM(cfg)
    b = 256
    dense = torch.rand(b, cfg.model.num_dense_features)
    ids = torch.randint(0, 100, (b, cfg.model.num_sparse_features))
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids), torch.rand(b)).backward()
    flops_per_sample = counter.get_total_flops() / b

    matmul_flops_per_s = _matmul_flops_per_s(3.0)
    return {
        "flops_per_sample": flops_per_sample,
        "matmul_gflops": matmul_flops_per_s / 1e9,
        "samples_per_s": matmul_flops_per_s / flops_per_sample,
        "threads": torch.get_num_threads(),
    }


# -- orchestration ------------------------------------------------------------------------


def _run_worker(which: str, train_args: list[str], steps: int, warmup: int, nproc: int = 1,
                precision: str = "fp32") -> dict[str, Any]:  # fmt: skip
    worker = ["-m", "torchrec_cloud", "bench", "--worker", which, "--steps", str(steps), "--warmup", str(warmup),
              "--precision", precision, "--", *train_args]  # fmt: skip
    if nproc > 1:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", *worker]  # fmt: skip
    else:
        cmd = [sys.executable, *worker]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench worker {which} (x{nproc}) failed with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def run_bench(batch_size: int, steps: int, warmup: int, extra: list[str], precision: str = "fp32") -> dict[str, Any]:
    train_args = [*QUICKSTART_ARGS, "--batch_size", str(batch_size), *extra]
    # A shared (cloud) machine's speed drifts by tens of percent within a minute, so the
    # measurements that the ratios compare bracket each other: bound, ours, ours on 2 ranks,
    # ours, bound. Each ratio then compares means centred on the same moment, and a steady
    # drift cancels.
    bound = _run_worker("bound", train_args, steps, warmup)
    ours_first = _run_worker("ours", train_args, steps, warmup, precision=precision)
    ours2 = _run_worker("ours", train_args, steps, warmup, nproc=2, precision=precision)
    ours_last = _run_worker("ours", train_args, steps, warmup, precision=precision)
    bound_end = _run_worker("bound", train_args, steps, warmup)
    hand = _run_worker("handwritten", train_args, steps, warmup)
    # The bound: the matmul rate measured in each 1-rank process just before and after its
    # timed steps (the bound runs' own rates, further away in time, where there is none).
    alongside = [*ours_first.get("matmul_gflops_around", []), *ours_last.get("matmul_gflops_around", [])]
    if len(alongside) == 4:
        gflops = sum(alongside) / 4
    else:
        alongside, gflops = [], (bound["matmul_gflops"] + bound_end["matmul_gflops"]) / 2
    bound_samples_per_s = gflops * 1e9 / bound["flops_per_sample"]
    ours = {
        "samples_per_s": (ours_first["samples_per_s"] + ours_last["samples_per_s"]) / 2,
        "peak_rss_mb": max(ours_first["peak_rss_mb"], ours_last["peak_rss_mb"]),
    }
    return {
        "batch_size": batch_size,
        "precision": precision,
        "cpu_cores": os.cpu_count(),
        "flops_per_sample": bound["flops_per_sample"],
        "matmul_gflops": gflops,
        "matmul_gflops_start": bound["matmul_gflops"],
        "matmul_gflops_end": bound_end["matmul_gflops"],
        "matmul_gflops_alongside_ours": alongside,
        "bound_samples_per_s": bound_samples_per_s,
        "ours_samples_per_s_runs": [ours_first["samples_per_s"], ours_last["samples_per_s"]],
        "ours_samples_per_s": ours["samples_per_s"],
        "ours_2rank_samples_per_s": ours2["samples_per_s"],
        "handwritten_samples_per_s": hand["samples_per_s"],
        "ours_peak_rss_mb": ours["peak_rss_mb"],
        "ours_2rank_peak_rss_mb_per_rank": ours2["peak_rss_mb"],
        "ours_2rank_collectives": ours2.get("collectives"),
        "handwritten_peak_rss_mb": hand["peak_rss_mb"],
        "ours_vs_bound": ours["samples_per_s"] / bound_samples_per_s,
        "ours_vs_handwritten": ours["samples_per_s"] / hand["samples_per_s"],
        "ours_2rank_vs_1rank": ours2["samples_per_s"] / ours["samples_per_s"],
        "cpu_kernels": ours_first.get("cpu_kernels", "-"),
    }


def format_table(r: dict[str, Any]) -> str:
    rows = [
        ("compute bound", r["bound_samples_per_s"], None, f"{r['flops_per_sample'] / 1e6:.2f} MFLOP/sample at {r['matmul_gflops']:.0f} GFLOP/s "
                          + (f"(around each 1-rank run: {', '.join(f'{g:.0f}' for g in r['matmul_gflops_alongside_ours'])}; "
                             f"alone at start and end: {r['matmul_gflops_start']:.0f}, {r['matmul_gflops_end']:.0f})"
                             if r.get("matmul_gflops_alongside_ours") else
                             f"(mean of {r['matmul_gflops_start']:.0f} and {r['matmul_gflops_end']:.0f})")),
        ("ours, 1 rank", r["ours_samples_per_s"], r["ours_peak_rss_mb"], f"{r['ours_vs_bound']:.0%} of bound "
                                                                           f"(mean of {r['ours_samples_per_s_runs'][0]:,.0f} and {r['ours_samples_per_s_runs'][1]:,.0f})"),
        ("ours, 2 ranks", r["ours_2rank_samples_per_s"], r["ours_2rank_peak_rss_mb_per_rank"], f"{r['ours_2rank_vs_1rank']:.2f}x 1 rank (RSS per rank; {r.get('ours_2rank_collectives') or 'gloo'})"),
        ("hand-written PyTorch", r["handwritten_samples_per_s"], r["handwritten_peak_rss_mb"], f"ours = {r['ours_vs_handwritten']:.2f}x"),
    ]
    lines = [f"quickstart model, batch {r['batch_size']}, {r['cpu_cores']} cores, CPU kernels: {r.get('cpu_kernels', '-')}", f"{'':<22}{'samples/s':>11}{'peak RSS MB':>13}  note"]
    for name, sps, rss, note in rows:
        lines.append(f"{name:<22}{sps:>11,.0f}{(f'{rss:,.0f}' if rss else '-'):>13}  {note}")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="measure training throughput against a plain-PyTorch DLRM and the compute bound",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--batch_size", type=int, default=2048, help="per-rank batch (default 2048)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="dense compute of our trainer: fp32 (default), tf32 (CUDA matmuls in TF32), "
                             "bf16 (bfloat16 autocast; tables and optimizer state stay fp32)")  # fmt: skip
    parser.add_argument("--profile", metavar="FILE",
                        help="with --worker ours: profile 5 more steps; top ops to FILE, a Chrome trace to FILE.trace.json")  # fmt: skip
    parser.add_argument("--gpu_memory", type=float, metavar="GB",
                        help="with --worker ours on a GPU: plan the tables for at most this many GiB of GPU memory "
                             "(as `plan --gpu_memory` does), so that the planner keeps in host memory (UVM, with a "
                             "cache) the tables a GPU of that size could not hold; the BENCH line then has the "
                             "cache's hit rate over the timed steps (uvm_cache_hit_rate)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    parser.add_argument("--worker", choices=["ours", "handwritten", "bound"],
                        help="measure one of them only, in this process (under torchrun: ours on its ranks), and "
                             "print its figures as one BENCH JSON line: what the comparison runs, and the GPU "
                             "scripts")  # fmt: skip
    parser.add_argument("train_args", nargs="*", help="extra train flags after --, e.g. -- --embedding_dim 128")
    parser.set_defaults(func=_main)
    return parser


def _main(ns: argparse.Namespace) -> int:
    from torchrec_cloud.config import ConfigError, parse_job_config

    for name in ("batch_size", "steps", "warmup"):
        if getattr(ns, name) <= 0:
            raise ConfigError(name, f"must be > 0, got {getattr(ns, name)}")
    if ns.gpu_memory is not None and ns.gpu_memory <= 0:
        raise ConfigError("gpu_memory", f"must be > 0 (GiB of GPU memory the planner plans for), got {ns.gpu_memory}")
    if ns.gpu_memory is not None and ns.worker != "ours":
        raise ConfigError("gpu_memory", "applies to one measurement of our trainer: add --worker ours")
    if ns.worker:
        cfg = parse_job_config(ns.train_args)
        if ns.worker == "ours":
            result = worker_ours(cfg, ns.steps, ns.warmup, ns.precision, ns.profile, ns.gpu_memory)
        elif ns.worker == "handwritten":
            result = worker_handwritten(cfg, ns.steps, ns.warmup)
        else:
            result = worker_bound(cfg)
        if result:
            print("BENCH " + json.dumps(result), flush=True)
        return 0
    result = run_bench(ns.batch_size, ns.steps, ns.warmup, ns.train_args, ns.precision)
    print(format_table(result))
    if ns.json:
        print(json.dumps(result))
    return 0
