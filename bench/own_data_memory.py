"""Peak memory of one preprocessing worker (``data preprocess --schema --workers 1``) on
crafted Parquet files that are small on disk and big once decoded, against an ordinary file:

- ``plain``: 40 ordinary rows;
- ``list_1e7``: one row whose list holds 10^7 zeros, run-length encoded (2 KB on disk);
- ``id_200mb``: one row whose id is 200 MB of one letter, under zstd (8 KB on disk);

each run as the command runs (a fresh process), with the caps (the row refused, then skipped
with ``--on_bad_line skip``) and with the cap lifted (``--max_list_length``/``--max_id_bytes``
set past the row), as the code before the caps read it. Prints the exit code and the peak
resident memory of each run (the child's ``ru_maxrss``)::

    python bench/own_data_memory.py            # a table
    python bench/own_data_memory.py --json     # one JSON object
    python bench/own_data_memory.py --src ../main/src    # another checkout's code (before the caps)

docs/data.md states the bound these figures illustrate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
ROWS = 40
SCHEMA = """
name: t
label: {column: clicked}
dense:
  - {name: price, transform: standardize}
sparse:
  - {name: user, type: string, mapping: vocab, num_embeddings: 100}
  - {name: tags, type: int, list: true, mapping: vocab, num_embeddings: 100}
"""
MEASURE = "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:], capture_output=True).returncode; " \
          "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"  # fmt: skip


def write_files(d: Path) -> dict[str, Path]:
    base = {"clicked": [i % 2 for i in range(ROWS)], "price": [float(i) for i in range(ROWS)],
            "user": [f"u{i % 5}" for i in range(ROWS)], "tags": [[i % 3] for i in range(ROWS)]}  # fmt: skip
    pq.write_table(pa.table(base), d / "plain.parquet")
    offsets = np.arange(ROWS + 1, dtype=np.int32)
    offsets[4:] += 10_000_000 - 1
    tags = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), np.int64)))
    pq.write_table(pa.table(dict(base, tags=tags)), d / "list_1e7.parquet")
    users = pa.array(["x" * 200_000_000 if i == 3 else f"u{i % 5}" for i in range(ROWS)])
    pq.write_table(pa.table(dict(base, user=users)), d / "id_200mb.parquet", compression="zstd")
    return {p.stem: p for p in sorted(d.glob("*.parquet"))}


def peak(d: Path, src: Path, path: Path, *extra: str) -> tuple[int, float]:
    """Exit code and peak RSS (GB) of one preprocessing run in a fresh process."""
    out = d / f"out-{path.stem}-{len(list(d.glob('out-*')))}"
    cmd = [sys.executable, "-m", "torchrec_cloud", "data", "preprocess", "--no_progress", "--workers", "1", "--schema",
           str(d / "schema.yaml"), "--input", str(path), "--output", str(out), *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rc, kb = subprocess.run([sys.executable, "-c", MEASURE, *cmd], env=env, capture_output=True, text=True,
                            check=True).stdout.split()  # fmt: skip
    return int(rc), int(kb) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--src", type=Path, default=REPO / "src", help="the package's sources to run (default: this checkout's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "schema.yaml").write_text(SCHEMA)
        files = write_files(d)
        lift = {"list_1e7": ["--max_list_length", "100000000"], "id_200mb": ["--max_id_bytes", str(1 << 30)], "plain": []}
        results = {}
        for name, path in files.items():
            row = {"file_bytes": path.stat().st_size}
            row["capped"] = peak(d, args.src, path)
            row["skipped"] = peak(d, args.src, path, "--on_bad_line", "skip")
            if lift[name]:
                row["cap_lifted"] = peak(d, args.src, path, *lift[name])
            results[name] = row
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'file':10} {'bytes':>7}  {'capped: exit, GB':>17}  {'skip: exit, GB':>15}  {'cap lifted: exit, GB':>21}")
    for name, row in results.items():
        cells = [f"{row[k][0]}, {row[k][1]:.2f}" if k in row else "-" for k in ("capped", "skipped", "cap_lifted")]
        print(f"{name:10} {row['file_bytes']:>7}  {cells[0]:>17}  {cells[1]:>15}  {cells[2]:>21}")


if __name__ == "__main__":
    main()
