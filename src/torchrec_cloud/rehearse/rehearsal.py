"""The rehearsal itself: render the bundle, run its pods under their controller with the
faults, report (the package docstring says what each part replays)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from torchrec_cloud.config import ConfigError, respelled
from torchrec_cloud.rehearse import report as reporting
from torchrec_cloud.rehearse.controllers import build_controller
from torchrec_cloud.rehearse.faults import KINDS, Fault, Faults
from torchrec_cloud.rehearse.pods import Pods
from torchrec_cloud.progress import plural

POLL_S = 0.05
SCRAPE_EVERY_S = 0.5


def _flag_value(args: list[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def rehearse(spec, faults: list[Fault], output: Path, timeout_s: float, delay_scale: float,
             say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Render ``spec``, run its pods under its controller's rules with ``faults``; the report."""
    from torchrec_cloud.deploy.manifests import load_documents, render_bundle
    from torchrec_cloud.deploy.profiles import load_profile

    bundle = render_bundle(spec)
    (output / "manifests.yaml").write_text(bundle)
    docs = load_documents(bundle)
    profile = load_profile(spec.cloud)
    pods_dir = output / "pods"
    pods_dir.mkdir(parents=True, exist_ok=True)
    base_env = {
        **os.environ,
        # The image puts its virtualenv first on PATH, with the package installed.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "TORCHREC_CLOUD_SHM": "0",  # pods on different nodes share no /dev/shm
    }
    pods = Pods(pods_dir, base_env, say)
    controller = build_controller(docs, spec.launcher, pods=pods, say=say, delay_scale=delay_scale)
    if spec.job == "preprocess":
        dataset = _flag_value(spec.train_args, "--output")
        run_dir = None
        progress = reporting.ShareProgress(dataset, spec.nodes)
    else:
        dataset = None
        run_dir = Path(_flag_value(spec.trainer_args("/unused"), "--output_dir") or "")
        progress = reporting.Progress(run_dir / "metrics.jsonl")

    def mark(attempt) -> None:
        progress.poll()
        attempt.progress_mark = progress.mark_of(attempt)

    controller.on_start = mark
    grace = spec.reclaim_grace_s or profile.spot["reclaim_grace_s"]
    injected = Faults(faults, pods, controller, grace, profile.lost_node, delay_scale, say)
    if spec.job != "preprocess":  # a preprocess's progress is its shares, not steps
        pods.hold_env = injected.hold_env
    served = {i: False for i in range(spec.nodes)}
    deadline = time.monotonic() + timeout_s
    last_scrape = 0.0
    timed_out = False
    try:
        while not controller.finished:
            if time.monotonic() > deadline:
                timed_out = True
                say(f"timed out after {timeout_s:g} s")
                break
            controller.tick()
            progress.poll()
            injected.tick(progress.step_of)
            if time.monotonic() - last_scrape > SCRAPE_EVERY_S:
                last_scrape = time.monotonic()
                for a in pods.live:
                    if a.metrics_port and not served[a.index] and not a.deleting and not a.lost:
                        served[a.index] = reporting.scrape(a.metrics_port)
            time.sleep(POLL_S)
    finally:
        pods.stop_all()
        controller.close()
    progress.poll()
    return reporting.build(spec, controller, faults, served, run_dir, timed_out, output, progress, dataset)


def _output_folder(ns: argparse.Namespace) -> Path:
    if ns.output:
        out = Path(ns.output).resolve()
        if out.exists() and any(out.iterdir()):
            raise ConfigError("output", f"{out} is not empty (a rehearsal would resume from what is there)")
    else:
        out = Path("runs", "rehearse", f"{ns.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(ns: argparse.Namespace) -> int:
    from torchrec_cloud.deploy.spec import preprocess_flags, spec_from_args, trainer_flags

    if ns.nproc_per_node < 1:
        raise ConfigError("nproc_per_node", f"must be >= 1, got {ns.nproc_per_node}")
    if ns.grace_s is not None and ns.grace_s < 1:
        raise ConfigError("grace_s", f"must be >= 1 (seconds), got {ns.grace_s}")
    if ns.job == "preprocess":  # --shares among its flags may set the pods' number
        ns.nodes = spec_from_args(ns).nodes
    faults = [Fault.parse(kind, text, ns.nodes) for kind in KINDS for text in getattr(ns, kind)]
    output = _output_folder(ns)
    ns.gpus_per_node, ns.procs_per_node, ns.instance_type = 0, ns.nproc_per_node, None
    ns.reclaim_grace_s = ns.grace_s
    if ns.job == "preprocess":  # the pods write the dataset where its --output says
        ns.train_args = respelled(ns.train_args or [], preprocess_flags())
    else:
        ns.train_args = respelled(ns.train_args or [], trainer_flags())  # `--output-dir` is `--output_dir`
        if not ns.checkpoint_url and "--checkpoint_path" not in (ns.train_args or []):
            ns.checkpoint_url = str(output / "checkpoints")
        if "--output_dir" not in (ns.train_args or []):
            ns.train_args = [*(ns.train_args or []), "--output_dir", str(output / "run")]
    start = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {message}", flush=True)

    if any(f.kind == "reclaim" for f in faults) and not ns.spot:
        ns.spot = True  # only spot nodes are reclaimed: the pods know the reclaim's grace
        say("--reclaim: rendering the job for spot nodes (--spot)")
    spec = spec_from_args(ns)
    say(f"rehearsing {spec.launcher} {spec.name}: {plural(spec.nodes, 'pod')} x {plural(spec.procs, 'process', 'processes')}, output {output}")

    def stop(signum, frame):  # the pods' processes must not outlive the rehearsal
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    report = rehearse(spec, faults, output, ns.timeout, ns.delay_scale, say)
    (output / "rehearsal.json").write_text(json.dumps(report, indent=1))
    for fault in faults:
        if not fault.fired:
            say(f"--{fault.kind} {fault.pod}@{fault.step}: never fired (no attempt of pod {fault.pod} saw the run "
                f"log step {fault.step})")  # fmt: skip
    print(reporting.summary(report))
    if ns.json:
        print(json.dumps(report))
    return 0 if report["completed"] else 1
