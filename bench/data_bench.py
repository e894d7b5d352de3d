"""Benchmark the Criteo data pipeline: preprocessing rows/s and reader samples/s.

Prints, for one generated Criteo-format file (Kaggle layout, planted signal):

- preprocessing rows/s of ``torchrec-cloud data preprocess`` with 1 process and with
  all cores, and of TorchRec's own TSV-to-npy utility (``BinaryCriteoUtils.tsv_to_npys``,
  one process, as its script runs it) on the same file in the same run;
- reader samples/s of the ``--dataset_path`` source at the trainer's batch size, in file
  order and shuffled;
- the trainer's samples/s on the same shards (quickstart model), and the ratio.

    python bench/data_bench.py                  # 300K rows, batch 2048
    python bench/data_bench.py --rows 1000000 --train_steps 0 --json

The last line with --json is one JSON object with every figure.
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from torchrec_cloud.data import criteo_tsv  # noqa: E402
from torchrec_cloud.data.preprocess import preprocess as run_preprocess  # noqa: E402
from torchrec_cloud.data.criteo_gen import write_criteo_tsv  # noqa: E402
from torchrec_cloud.data.reader import criteo_source  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def preprocess(tsv: Path, out: Path, workers: int) -> float:
    """Seconds of ``data preprocess`` (the conversion itself, without interpreter start-up)."""
    opts = criteo_tsv.Options(
        dataset="kaggle", inputs=[str(tsv)], input_sizes=[tsv.stat().st_size], output=str(out),
        num_embeddings_per_feature=[100000] * 26, on_bad_line="error", chunk_bytes=16 << 20,
        rows_per_shard=500_000,
    )
    result = run_preprocess(opts, workers=workers)  # the one preprocessor, Criteo's TSV as its input
    # The one dataset format, Criteo as the built-in schema: what `train --dataset_path` reads.
    assert result.manifest["format"] == "torchrec-cloud-shards" and result.manifest["schema"]["name"] == "criteo"
    return result.seconds


def torchrec_npy(tsv: Path, tmp: Path) -> float:
    from torchrec.datasets.criteo import BinaryCriteoUtils

    names = [str(tmp / f"ref_{k}.npy") for k in ("dense", "sparse", "labels")]
    return timed(lambda: BinaryCriteoUtils.tsv_to_npys(str(tsv), *names, dataset_name="criteo_1tb"))


def reader(path: Path, batch_size: int, shuffle: bool) -> float:
    src = criteo_source(str(path), batch_size=batch_size, rank=0, world_size=1,
                       table_sizes=[100000] * 26, shuffle=shuffle)
    n = 0
    t = time.perf_counter()
    for batch in src.train_batches(0):
        n += batch.labels.numel()
    return n / (time.perf_counter() - t)


def trainer(path: Path, batch_size: int, steps: int, tmp: Path) -> tuple[float, float]:
    """Samples/s of the quickstart model training on the shards (one process), and the
    share of step time the loop spent waiting for the next batch."""
    out = tmp / "train-run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torchrec_cloud", "train", "--preset", "quickstart",
           "--dataset_path", str(path), "--batch_size", str(batch_size), "--num_epochs", "1",
           "--no-progress", "--no-tensorboard", "--output_dir", str(out), "--log_every", "5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("event") == "train"]
    # Skip the first window (warm-up); the median of the rest.
    window = train[1:steps] or train[-1:]
    rate = float(np.median([r["samples_per_s"] for r in window]))
    waits = [r["data_wait_s"] / r["step_s"] for r in window if r.get("step_s")]
    return rate, (float(np.mean(waits)) if waits else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--train_steps", type=int, default=30,
                    help="train records to average for the trainer figure (0: skip training)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="data-bench-") as tmpdir:
        tmp = Path(tmpdir)
        tsv = tmp / "train.txt"
        write_criteo_tsv(str(tsv), rows=ns.rows, seed=0, vocab=5000)
        mb = tsv.stat().st_size / 2**20
        print(f"input: {ns.rows:,} rows, {mb:.1f} MiB Kaggle-format TSV; {cores} cores")
        ref_s = torchrec_npy(tsv, tmp)
        one_s = preprocess(tsv, tmp / "ours-1", workers=1)
        all_s = preprocess(tsv, tmp / "ours-all", workers=cores)
        res = {
            "rows": ns.rows,
            "cores": cores,
            "torchrec_rows_per_s": ns.rows / ref_s,
            "ours_1proc_rows_per_s": ns.rows / one_s,
            "ours_all_cores_rows_per_s": ns.rows / all_s,
            "ours_per_core_rows_per_s": ns.rows / all_s / cores,
        }
        res["speedup_1proc_vs_torchrec"] = ref_s / one_s
        res["speedup_all_cores_vs_torchrec"] = ref_s / all_s
        print(f"preprocess  torchrec tsv_to_npys (1 proc)  {res['torchrec_rows_per_s']:>12,.0f} rows/s")
        print(f"preprocess  ours, 1 process                {res['ours_1proc_rows_per_s']:>12,.0f} rows/s"
              f"  ({res['speedup_1proc_vs_torchrec']:.1f}x torchrec)")
        print(f"preprocess  ours, {cores} processes              {res['ours_all_cores_rows_per_s']:>12,.0f} rows/s"
              f"  ({res['ours_per_core_rows_per_s']:,.0f} per core; {res['speedup_all_cores_vs_torchrec']:.1f}x torchrec)")
        data = tmp / "ours-all"
        res["reader_samples_per_s"] = reader(data, ns.batch_size, shuffle=False)
        res["reader_shuffled_samples_per_s"] = reader(data, ns.batch_size, shuffle=True)
        print(f"reader      batch {ns.batch_size}, file order          {res['reader_samples_per_s']:>12,.0f} samples/s")
        print(f"reader      batch {ns.batch_size}, --shuffle           {res['reader_shuffled_samples_per_s']:>12,.0f} samples/s")
        if ns.train_steps:
            rate, wait = trainer(data, ns.batch_size, ns.train_steps, tmp)
            res["trainer_samples_per_s"] = rate
            res["trainer_data_wait_fraction"] = wait
            res["reader_over_trainer"] = res["reader_shuffled_samples_per_s"] / rate
            print(f"trainer     quickstart model, batch {ns.batch_size}  {rate:>12,.0f} samples/s"
                  f"  (reader, shuffled, is {res['reader_over_trainer']:.1f}x; "
                  f"{100 * wait:.1f}% of step time waiting for data)")
    if ns.json:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
