"""How long `torchrec-cloud --help` and `torchrec-cloud train --help` take, 7 runs each.

    python bench/cli_help_bench.py                       # this checkout's src/
    python bench/cli_help_bench.py OLD/src NEW/src       # two source trees, side by side

The top-level help imports no command module (and so no torch); `train --help` imports the
trainer, torch and TorchRec with it.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main(trees: list[str]) -> None:
    for src in trees:
        for argv in (["--help"], ["train", "--help"]):
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "torchrec_cloud", *argv],
                               env=dict(os.environ, PYTHONPATH=src), capture_output=True, check=True)  # fmt: skip
                times.append(time.perf_counter() - t0)
            print(f"{src}: torchrec-cloud {' '.join(argv):13} min {min(times):.2f} s, median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main(sys.argv[1:] or [str(Path(__file__).resolve().parents[1] / "src")])
