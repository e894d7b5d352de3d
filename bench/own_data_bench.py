"""Benchmark the own-data pipeline: preprocessing rows/s per core for Parquet and CSV input
against pyarrow's own read rate of the same files, and the shards' reader against the trainer.

Prints, for generated events (data/events_gen.py: string and integer ids, two list features,
missing values; the same rows as one Parquet file and one CSV file):

- pyarrow reading each file whole on one thread (``pq.read_table``, ``pyarrow.csv.read_csv``
  with ``use_threads=False``): rows/s, the ceiling a converter that reads through pyarrow has;
- ``data preprocess --schema`` on one process (counting pass and conversion, as the command
  runs them), rows/s per core, and its share of pyarrow's read rate;
- the ``--dataset_path`` reader's samples/s at the trainer's batch size, in file order and
  shuffled;
- the trainer's samples/s on the same shards (one process; the quickstart model's widths),
  and the reader's multiple of it.

    python bench/own_data_bench.py                       # 1M rows, batch 2048
    python bench/own_data_bench.py --rows 20000 --train_steps 5 --json    # a quick check

A timing: run it on a quiet machine. The last line with --json is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from torchrec_cloud.data import events_gen  # noqa: E402
from torchrec_cloud.data.dataset import load_dataset  # noqa: E402
from torchrec_cloud.data.preprocess import Options, preprocess  # noqa: E402
from torchrec_cloud.data.schema import Split, parse_schema  # noqa: E402
from torchrec_cloud.untrusted import parse_yaml  # noqa: E402



def write_inputs(work: Path, rows: int) -> tuple[Path, Path]:
    cols = events_gen.generate(rows, 0, seed=0)
    parquet, csv = work / "events.parquet", work / "events.csv"
    pq.write_table(events_gen.table_of(cols), parquet, row_group_size=100_000)
    events_gen.write_csv(str(csv), cols)
    return parquet, csv


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def pyarrow_rate(path: Path, rows: int) -> float:
    if path.suffix == ".parquet":
        seconds = best_of(3, lambda: pq.read_table(path, use_threads=False))
    else:
        seconds = best_of(3, lambda: pcsv.read_csv(path, read_options=pcsv.ReadOptions(use_threads=False)))
    return rows / seconds


def preprocess_rate(path: Path, out: Path, rows: int) -> float:
    schema = parse_schema(parse_yaml(events_gen.SCHEMA, "bench"), "bench")
    opts = Options(schema, [str(path)], str(out), Split("hash:user", 0.8, 0.9), rows_per_shard=500_000)
    t = time.perf_counter()
    preprocess(opts, workers=1)
    return rows / (time.perf_counter() - t)


def reader_rate(path: Path, batch_size: int, shuffle: bool) -> float:
    from torchrec_cloud.data.reader import SchemaSource

    source = SchemaSource(load_dataset(str(path)), batch_size=batch_size, rank=0, world_size=1, shuffle=shuffle)
    n, t = 0, time.perf_counter()
    for batch in source.train_batches(0):
        n += batch.labels.numel()
    return n / (time.perf_counter() - t)


def trainer_rate(path: Path, batch_size: int, steps: int, work: Path) -> float:
    """Samples/s of one training process on the shards (the quickstart model's widths)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = work / "train-run"
    cmd = [sys.executable, "-m", "torchrec_cloud", "train", "--dataset_path", str(path), "--batch_size", str(batch_size),
           "--num_epochs", "1", "--eval_every", "0", "--log_every", str(max(1, steps // 4)), "--no-progress",
           "--no-tensorboard", "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("event") == "train"][1:] or [r for r in records if r.get("event") == "train"]
    return sum(r["samples_per_s"] for r in train) / len(train)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--train_steps", type=int, default=100, help="steps of the trainer's run (0: skip it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result: dict = {"rows": args.rows, "batch_size": args.batch_size, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="own-data-bench-") as tmp:
        work = Path(tmp)
        parquet, csv = write_inputs(work, args.rows)
        result["parquet_mib"] = round(parquet.stat().st_size / 2**20, 1)
        result["csv_mib"] = round(csv.stat().st_size / 2**20, 1)
        for name, path in (("parquet", parquet), ("csv", csv)):
            result[f"pyarrow_read_{name}_rows_per_s"] = pyarrow_rate(path, args.rows)
            result[f"preprocess_{name}_rows_per_s_per_core"] = preprocess_rate(path, work / f"shards-{name}", args.rows)
            result[f"preprocess_{name}_share_of_pyarrow_read"] = (
                result[f"preprocess_{name}_rows_per_s_per_core"] / result[f"pyarrow_read_{name}_rows_per_s"])
        shards = work / "shards-parquet"
        result["reader_samples_per_s"] = reader_rate(shards, args.batch_size, False)
        result["reader_shuffled_samples_per_s"] = reader_rate(shards, args.batch_size, True)
        if args.train_steps:
            steps = max(1, min(args.train_steps, int(args.rows * 0.8) // args.batch_size))
            result["trainer_samples_per_s"] = trainer_rate(shards, args.batch_size, steps, work)
            result["reader_over_trainer"] = result["reader_shuffled_samples_per_s"] / result["trainer_samples_per_s"]
    for key, value in result.items():
        print(f"{key:45s} {value:,.2f}" if isinstance(value, float) else f"{key:45s} {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
