"""What export and predict cost, and what quantizing the tables costs in AUC.

Trains the quickstart model (26 tables x 100,000 rows x dim 64) for one epoch on 2 ranks
(torchrun) on generated Criteo TSV with a planted signal, preprocessed like real data;
exports its last checkpoint with ``--quantize none``, ``fp16`` and ``int8``; and scores the
validation split with each through ``predict``::

    PYTHONPATH=src python bench/serving_bench.py              # 280,000 rows
    PYTHONPATH=src python bench/serving_bench.py --rows 700000 --json

Printed per quantization: the export's seconds and scorer.pt size, the validation AUC and
log loss predict reports with it (and the change against float32), and predict's rows/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import explain, torchrun  # noqa: E402


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "torchrec_cloud", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(explain(proc))
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=280_000, help="rows of generated Criteo TSV")
    parser.add_argument("--batch_size", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    from torchrec_cloud.data.criteo_gen import write_criteo_tsv

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_criteo_tsv(str(root / "day.txt"), rows=ns.rows, seed=0, vocab=5000)
        cli("data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(root / "day.txt"),
            "--output", str(root / "data"), "--num_embeddings", "100000")  # fmt: skip
        proc = torchrun(2, ["-m", "torchrec_cloud", "train", "--preset", "quickstart", "--dataset_path",
                            str(root / "data"), "--batch_size", str(ns.batch_size), "--no-progress",
                            "--no-tensorboard", "--output_dir", str(root / "run"), "--checkpoint_path",
                            str(root / "ck")])  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(explain(proc))
        results = {}
        for quantize in ("none", "fp16", "int8"):
            start = time.perf_counter()
            exported = json.loads(cli("export", str(root / "ck"), "--output", str(root / quantize),
                                      "--quantize", quantize, "--json"))  # fmt: skip
            seconds = time.perf_counter() - start
            scored = json.loads(cli("predict", str(root / quantize), "--dataset_path", str(root / "data"),
                                    "--split", "val", "--output", str(root / f"{quantize}.csv"),
                                    "--no_progress", "--json", "--batch_size", "4096"))  # fmt: skip
            results[quantize] = {
                "export_s": round(seconds, 2),
                "scorer_mib": round(exported["files"]["scorer.pt"] / 2**20, 1),
                "weights_mib": round(exported["files"]["weights.pt"] / 2**20, 1),
                "val_rows": scored["rows"],
                "auc": scored["auc"],
                "logloss": scored["logloss"],
                "predict_rows_per_s": round(scored["rows_per_s"]),
            }
        for quantize in ("fp16", "int8"):
            results[quantize]["auc_change"] = results[quantize]["auc"] - results["none"]["auc"]
            results[quantize]["logloss_change"] = results[quantize]["logloss"] - results["none"]["logloss"]
    if ns.json:
        print(json.dumps(results))
        return
    for quantize, r in results.items():
        change = f"  AUC change {r['auc_change']:+.6f}" if "auc_change" in r else ""
        print(
            f"{quantize:>5}: export {r['export_s']:.1f}s  scorer.pt {r['scorer_mib']} MiB  "
            f"val AUC {r['auc']:.6f} logloss {r['logloss']:.6f} ({r['val_rows']} rows){change}  "
            f"predict {r['predict_rows_per_s']} rows/s"
        )


if __name__ == "__main__":
    main()
