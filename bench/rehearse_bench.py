"""What a spot reclaim and a lost node cost, per cloud and launcher, measured with
``torchrec-cloud rehearse``: the steps lost (trained past the checkpoint the next start
resumes from) and the downtime (from the fault to the first step of the next start), with
the controllers' real delays (``--delay_scale 1``: a lost node waits its 410 s).

    python bench/rehearse_bench.py                      # every scenario (about 40 minutes)
    python bench/rehearse_bench.py --only reclaim       # reclaims only (about 15 minutes)
    python bench/rehearse_bench.py --only reclaim --clouds gcp --launchers job --delay_scale 0.01   # a check

Each scenario trains the same small model (60 steps of 2 pods, a checkpoint every 10) and
hits it at step 25. A reclaim runs twice: as is (the small model's save fits any grace: no
step is lost) and with a save that takes longer than any reclaim's grace
(``TORCHREC_CLOUD_TEST_SAVE_DELAY_S``, the large-model case: the run resumes from the last
periodic checkpoint). Prints a Markdown table for bench/RESULTS.md. Timings need a quiet
machine: the pods of a rehearsal share its cores.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
MODEL = [
    "--num_embeddings", "1000", "--embedding_dim", "16", "--dense_arch_layer_sizes", "32,16",
    "--over_arch_layer_sizes", "32,1", "--batch_size", "64", "--num_batches_per_epoch", "20",
    "--num_epochs", "3", "--num_eval_batches", "2", "--log_every", "1", "--checkpoint_interval", "10",
    "--no-progress", "--no-tensorboard",
]  # fmt: skip
STEP = 25
LARGE_SAVE_S = "600"  # longer than any cloud's reclaim grace


def scenarios(only: str, launchers: list[str], clouds: list[str]) -> list[dict]:
    out = []
    if only in ("all", "reclaim"):
        for cloud in clouds:
            for launcher in launchers:
                for large in (False, True):
                    out.append({"cloud": cloud, "launcher": launcher, "fault": "reclaim", "large_save": large})
    if only in ("all", "lose"):
        for launcher in launchers:  # pod 0: its peers lose the rendezvous store with it
            out.append({"cloud": "generic", "launcher": launcher, "fault": "lose", "pod": 0, "large_save": False})
    return out


def run(scenario: dict, delay_scale: float, folder: Path) -> dict:
    pod = scenario.get("pod", 1)
    out = folder / f"{scenario['cloud']}-{scenario['launcher']}-{scenario['fault']}-{pod}-{int(scenario['large_save'])}"
    cmd = [sys.executable, "-m", "torchrec_cloud", "rehearse", "--cloud", scenario["cloud"],
           "--launcher", scenario["launcher"], "--nodes", "2", "--output", str(out), "--json",
           "--delay_scale", str(delay_scale), f"--{scenario['fault']}", f"{pod}@{STEP}", "--", *MODEL]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    if scenario["large_save"]:
        env["TORCHREC_CLOUD_TEST_SAVE_DELAY_S"] = LARGE_SAVE_S
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["wall_s"] = time.monotonic() - start
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["all", "reclaim", "lose"], default="all")
    parser.add_argument("--launchers", default="job,pytorchjob,trainjob")
    parser.add_argument("--clouds", default="gcp,azure,aws", help="the profiles whose reclaim grace to rehearse")
    parser.add_argument("--delay_scale", type=float, default=1.0)
    parser.add_argument("--output", help="keep the rehearsals here (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.output or tempfile.mkdtemp(prefix="rehearse-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"rehearsals in {folder}; --delay_scale {args.delay_scale:g}", file=sys.stderr)
    from torchrec_cloud.deploy.profiles import load_profile

    print("| cloud | grace (s) | launcher | fault | save on SIGTERM | steps lost | downtime (s) | restarts | completed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario in scenarios(args.only, args.launchers.split(","), args.clouds.split(",")):
        report = run(scenario, args.delay_scale, folder)
        (fault,) = report["faults"]
        save = "takes 600 s" if scenario["large_save"] else "fits" if scenario["fault"] == "reclaim" else "-"
        grace = load_profile(scenario["cloud"]).reclaim_grace_s() if scenario["fault"] == "reclaim" else "-"
        print(f"| {scenario['cloud']} | {grace} | {scenario['launcher']} | {fault['kind']} pod {fault['pod']} | {save} | "
              f"{fault['lost_steps']} | {fault['downtime_s']} | {report['restarts']} | {report['completed']} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
