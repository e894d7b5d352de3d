"""How often a peer's death spends a survivor's restart: the two-pod kill rehearsal, N times,
beside a CPU hog (issue #38).

    python bench/lost_peer_stress.py                    # 20 runs, a hog on every core
    python bench/lost_peer_stress.py --runs 5 --hogs 0  # a check on a quiet machine

Each run is ``torchrec-cloud rehearse --launcher job --nodes 2 --kill 1@25 --kill 0@45`` (the
rehearsed test ``tests/test_rehearse.py::test_a_killed_pod_is_a_counted_crash_of_that_pod_only``):
an OOM kill of pod 1, then, in the next attempt, of pod 0 with the rendezvous store. The hog
(busy processes at the lowest priority the machine has left: they still take cores from the
pods) is what makes the survivor's worker end long before its launcher's verdict. A run
*spent a restart* when a pod's log says torchrun's agent restarted its workers in place
(``will restart worker group``); it *failed* when the job did not complete or a pod exited 1.
Prints one line per run and a summary; exit 0 only when no run spent a restart or failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from rehearse_bench import MODEL  # noqa: E402 - the rehearsals' small model: 60 steps, a checkpoint every 10


def _burn(stop_at: float) -> None:
    os.nice(5)
    x = 0
    while time.time() < stop_at:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def one_run(folder: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "torchrec_cloud", "rehearse", "--cloud", "generic", "--launcher", "job",
           "--nodes", "2", "--output", str(folder), "--json", "--timeout", str(int(timeout_s)),
           "--delay_scale", "0.005", "--peer_timeout_s", "6", "--kill", "1@25", "--kill", "0@45", "--", *MODEL]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 120)
    lines = proc.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"completed": False, "restarts_spent": None, "seconds": time.monotonic() - started,
                "why": f"no report (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"}  # fmt: skip
    logs = "".join(Path(log).read_text(errors="replace") for pod in report["pods"] for log in pod["logs"])
    codes = [pod["exit_codes"] for pod in report["pods"]]
    return {
        "completed": bool(report["completed"]),
        "restarts_spent": logs.count("will restart worker group"),
        "exit_1": any(1 in c for c in codes),
        "exit_codes": codes,
        "seconds": time.monotonic() - started,
        "why": report.get("outcome", ""),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes beside the pods")
    parser.add_argument("--timeout_s", type=float, default=900, help="one rehearsal's limit")
    parser.add_argument("--output", default=None, help="where the runs' folders go (default: a temporary folder)")
    args = parser.parse_args()

    root = Path(args.output or tempfile.mkdtemp(prefix="lost-peer-stress-"))
    root.mkdir(parents=True, exist_ok=True)
    spent = failed = 0
    started = time.monotonic()
    for i in range(args.runs):
        stop_at = time.time() + args.timeout_s + 120
        hogs = [multiprocessing.Process(target=_burn, args=(stop_at,), daemon=True) for _ in range(args.hogs)]
        for hog in hogs:
            hog.start()
        try:
            result = one_run(root / f"run{i:02d}", args.timeout_s)
        finally:
            for hog in hogs:
                hog.terminate()
                hog.join()
        bad = not result["completed"] or result.get("exit_1")
        spent += bool(result["restarts_spent"])
        failed += bool(bad)
        print(f"run {i + 1}/{args.runs}: completed={result['completed']} restarts_spent={result['restarts_spent']} "
              f"exit_codes={result.get('exit_codes')} {result['seconds']:.0f} s"
              + (f" ({result['why']})" if bad else ""), flush=True)  # fmt: skip
    print(f"SUMMARY runs={args.runs} hogs={args.hogs} spent_a_restart={spent} failed={failed} "
          f"minutes={(time.monotonic() - started) / 60:.1f} folder={root}")
    return 0 if spent == 0 and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
