"""How much checkpoints cost: size, save time, load time, and training stall per save.

Trains the quickstart model (26 tables x 100,000 rows x dim 64) in this process (one
rank) with the real training loop, saving every ``--interval`` steps, synchronously and
asynchronously, to a local folder and to the S3 emulator (moto, started here on
127.0.0.1), and once without checkpoints as the baseline. Mode ``sync`` records a checksum
of every file as it is written (the default) and verifies them on load; ``nosum`` is the
same save with ``--no-checkpoint_checksums`` (file sizes only), for their cost::

    PYTHONPATH=src python bench/checkpoint_bench.py               # defaults below
    PYTHONPATH=src python bench/checkpoint_bench.py --steps 30 --interval 10 --json
    PYTHONPATH=src python bench/checkpoint_bench.py --modes sync,nosum   # checksums' cost

Printed per destination and mode:

- ``save_s``: from the start of a save until it is committed (median over the saves);
- ``stall_s``: how long the training loop was blocked by a save (sync: all of it; async:
  copying the state in memory, plus waiting for the write where the next save comes first);
- ``overhead_s``: extra training wall time per save against the run without checkpoints
  (the stall plus the slowdown of steps that share the CPU with a background write);
- ``load_s``: resuming from the last checkpoint (verifying every block read, but in ``nosum``);
- ``hash_s``: hashing the last checkpoint's files read back (XXH3 per block, one thread),
  the work checksums add to a save, without the noise of two runs (local destination);
- ``stall_%_1000``: ``stall_s`` as a share of 1000 training steps (the goal for async
  saves is below 5%); ``overhead_%_1000`` the same for ``overhead_s``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the project's storage emulators


def train(flags: list[str], out: Path) -> tuple[dict, list[dict]]:
    from torchrec_cloud.config import parse_job_config
    from torchrec_cloud.train import run

    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "metrics.jsonl"
    if records_path.exists():
        records_path.unlink()
    result = run(parse_job_config([*flags, "--output_dir", str(out)]))
    gc.collect()
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    return result, records


def train_seconds(records: list[dict]) -> float:
    return next(r for r in records if r.get("event") == "end")["seconds"]


def measure(base: list[str], destination: str, mode: str, baseline_s: float, steps: int, work: Path,
            run: str) -> dict[str, Any]:  # fmt: skip
    from torchrec_cloud import checkpoint, checksum, storage

    root = f"{destination}/{run}"  # a folder per run: a run finding another's checkpoints would resume
    flags = [*base, "--checkpoint_path", root, "--checkpoint_keep", "1"]
    if mode == "async":
        flags.append("--async_checkpoint")
    elif mode == "nosum":
        flags.append("--no-checkpoint_checksums")
    _, records = train(flags, work / f"{run}-save")
    saves = [r for r in records if r.get("event") == "checkpoint"]
    overhead = (train_seconds(records) - baseline_s) / len(saves)
    step_s = baseline_s / steps

    # Resume from the last checkpoint: training is done, so this loads and evaluates.
    _, resumed = train(flags, work / f"{run}-load")
    load_s = next(r for r in resumed if r.get("event") == "resume")["seconds"]
    info = checkpoint.newest_complete(root)
    stall = statistics.median(r["stall_s"] for r in saves)
    hashed = {}
    if not storage.is_url(root):
        start = time.perf_counter()
        for name in info.commit["files"]:
            checksum.hash_file(storage.join(root, info.name, name))
        hashed["hash_s"] = round(time.perf_counter() - start, 3)
    return {
        "saves": len(saves),
        "bytes": info.bytes,
        "save_s": round(statistics.median(r["seconds"] for r in saves), 3),
        "stall_s": round(stall, 3),
        "overhead_s": round(overhead, 3),
        "load_s": round(load_s, 3),
        "stall_%_1000": round(100 * stall / (1000 * step_s), 3),
        "overhead_%_1000": round(100 * max(overhead, 0.0) / (1000 * step_s), 3),
        **hashed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--interval", type=int, default=10, help="steps between checkpoints (default 10)")
    parser.add_argument("--batch_size", type=int, default=2048, help="batch size (default 2048)")
    parser.add_argument("--destinations", default="local,s3", help="comma-separated: local, s3")
    parser.add_argument("--modes", default="sync,nosum,async",
                        help="comma-separated: sync, nosum (sync without checksums), async; "
                        "repeat them to alternate runs (sync,nosum,sync,nosum)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()

    from torchrec_cloud.progress import quiet_library_warnings

    quiet_library_warnings()
    base = [
        "--preset", "quickstart", "--batch_size", str(args.batch_size),
        "--num_batches_per_epoch", str(args.steps), "--num_eval_batches", "1",
        "--log_every", str(args.steps), "--no-progress", "--no-tensorboard",
    ]  # fmt: skip
    results: dict[str, Any] = {"steps": args.steps, "interval": args.interval, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        work = Path(tmp)
        train(base, work / "warmup")  # first-run costs (imports, allocator) out of the figures
        _, records = train(base, work / "baseline")
        baseline_s = train_seconds(records)
        results["step_s"] = round(baseline_s / args.steps, 4)
        s3 = None
        try:
            for destination in args.destinations.split(","):
                if destination == "local":
                    url = str(work / "ckpt")
                elif destination == "s3":
                    from services import S3Service

                    s3 = S3Service().start()
                    os.environ.update(s3.env)
                    url = f"{s3.url}/bench"
                else:
                    parser.error(f"--destinations: unknown {destination!r} (local, s3)")
                for mode in args.modes.split(","):
                    if mode not in ("sync", "nosum", "async"):
                        parser.error(f"--modes: unknown {mode!r} (sync, nosum, async)")
                    flags = [*base, "--checkpoint_interval", str(args.interval)]
                    key, n = f"{destination}_{mode}", 2
                    while key in results:  # a mode listed again (alternating runs): sync#2, ...
                        key, n = f"{destination}_{mode}#{n}", n + 1
                    run = key.split("_", 1)[1].replace("#", "-")
                    results[key] = measure(flags, url, mode, baseline_s, args.steps, work, run)
        finally:
            if s3 is not None:
                s3.stop()

    size = next(v["bytes"] for k, v in results.items() if isinstance(v, dict))
    print(f"\nquickstart model, batch {args.batch_size}, 1 rank: step {results['step_s']:.3f} s; "
          f"checkpoint {size / 2**20:.1f} MiB")  # fmt: skip
    header = ("save_s", "stall_s", "overhead_s", "load_s", "stall_%_1000", "overhead_%_1000")
    print(f"{'destination':<12} {'mode':<6} " + " ".join(f"{h:>15}" for h in header))
    for key, row in results.items():
        if isinstance(row, dict):
            destination, mode = key.rsplit("_", 1)
            print(f"{destination:<12} {mode:<6} " + " ".join(f"{row[h]:>15}" for h in header)
                  + (f"   hash_s {row['hash_s']}" if "hash_s" in row else ""))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
