"""``torchrec-cloud render``: Kubernetes manifests for a training job (or a preprocessing
job), on stdout or in files.

    torchrec-cloud render --cloud generic --launcher job --nodes 2 --gpus_per_node 1
    torchrec-cloud render --cloud aws --launcher pytorchjob --nodes 4 --gpus_per_node 8 \\
        --image 111122223333.dkr.ecr.us-west-2.amazonaws.com/torchrec-cloud:0.1.0 --preset criteo-1tb \\
        --spot --checkpoint_url s3://your-criteo-bucket/checkpoints -- --batch_size 4096
    torchrec-cloud render --cloud gcp --launcher trainjob --nodes 2 --gpus_per_node 8 --output out/
    torchrec-cloud render --cloud azure --what storage --set storage.nfs_server=10.1.2.3 | kubectl apply -f -
    torchrec-cloud render --cloud aws --job preprocess --nodes 8 -- --schema /fsx/schema.yaml \\
        --input s3://your-bucket/events/ --output s3://your-bucket/events-shards

``--job preprocess`` renders ``data preprocess`` over ``--nodes`` CPU pods (an Indexed Job,
one share of the inputs each); its flags go after ``--``, as ``data preprocess`` takes them.
``--job serve --model_url URL`` renders ``serve`` replicas: a Deployment, Service, autoscaler
(``--autoscaler hpa|keda``), PodDisruptionBudget and NetworkPolicy, or with ``--launcher
kserve`` a KServe InferenceService (deploy/serving.py); ``serve`` flags go after ``--``.

    torchrec-cloud render --job serve --cloud aws --model_url s3://your-bucket/models/q

Without ``--output`` the multi-document YAML goes to stdout (``| kubectl apply -f -``); with
it, ``DIR/<launcher>.yaml`` (``DIR/preprocess.yaml``, ``DIR/serve.yaml``) (and ``DIR/storage.yaml`` where the profile has a file system).
Bad options end with one line naming the flag, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchrec_cloud.deploy.manifests import render_bundle, render_storage
from torchrec_cloud.deploy.profiles import load_profile, with_values
from torchrec_cloud.deploy.spec import add_spec_flags, spec_from_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "render",
        help="render Kubernetes manifests (Indexed Job, PyTorchJob, TrainJob; or a preprocessing job) for a cloud",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_spec_flags(parser)
    parser.add_argument(
        "--what",
        choices=["job", "storage"],
        default="job",
        help="the training job bundle (default) or the profile's storage PersistentVolume + claim",
    )
    parser.add_argument("--output", metavar="DIR", help="write files into DIR instead of stdout")
    parser.add_argument(
        "--set",
        dest="profile_values",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change one value of the cloud profile for this render, e.g. your file system's in the storage "
        "PersistentVolume: --set storage.nfs_server=10.1.2.3 (repeatable; KEY as in profiles/<cloud>.yaml)",
    )
    parser.set_defaults(func=run)
    return parser


def run(ns: argparse.Namespace) -> int:
    spec = spec_from_args(ns)
    profile = with_values(load_profile(spec.cloud), ns.profile_values)
    if ns.what == "storage":
        text = render_storage(spec, profile)
        if text is None:
            print(f"torchrec-cloud render: profile {spec.cloud!r} has no storage", file=sys.stderr)
            return 2
        files = {"storage.yaml": text}
    else:
        name = spec.job if spec.job in ("preprocess", "serve", "daily") else spec.launcher
        files = {f"{name}.yaml": render_bundle(spec, profile)}
        storage = render_storage(spec, profile) if ns.output else None
        if storage:
            files["storage.yaml"] = storage
    if not ns.output:
        sys.stdout.write(next(iter(files.values())))
        return 0
    out = Path(ns.output)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        print(out / name)
    return 0
