"""``torchrec-cloud submit``: render a training job and hand it to a cluster or a cloud service.

    torchrec-cloud submit --target kubernetes --cloud aws --nodes 2 --image IMG --dry-run
    torchrec-cloud submit --target kubernetes --cloud gcp --launcher trainjob --nodes 2 --image IMG \\
        --identity GSA --storage_claim filestore-pvc --follow -- --batch_size 4096
    torchrec-cloud submit --target azureml --cloud azure --nodes 2 --image IMG \\
        --subscription_id SUB --workspace WS --compute gpu-cluster
    torchrec-cloud submit --target vertex --cloud gcp --nodes 2 --image IMG --project P \\
        --staging_bucket gs://BUCKET

``--job serve --model_url URL`` submits serving replicas (``render --job serve``) the same way.

``kubernetes`` applies the manifests of ``torchrec-cloud render`` with ``kubectl apply``
(``--follow`` then waits for the pods and streams their logs); ``azureml`` and ``vertex``
build the job with the cloud's SDK (extras ``azure``, ``gcp``) and submit it. ``--dry-run``
prints exactly what would be submitted and touches nothing. A real submission refuses
what cannot work as it stands (exit 2, one line each): the default image (no registry), a
profile's example values (account ids, identities, registries, buckets), and a volume the
bundle mounts but neither creates nor was told exists (``--storage_claim``). Before applying,
``kubernetes`` compares the cluster's version (``kubectl version``) with the one the bundle
records it needs (``torchrec-cloud/min-kubernetes``, :mod:`.admission`) and refuses an older
cluster, which would drop the fields it does not know without a word.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

from torchrec_cloud.deploy.manifests import JOB_LABEL, load_documents, render_bundle
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.spec import DeploySpec, MissingExtraError, add_spec_flags, spec_from_args


class SubmitError(RuntimeError):
    """Submission failed (kubectl missing or refusing, cloud API error)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "submit",
        help="submit a training job to Kubernetes (kubectl), Azure ML or Vertex AI",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_submit_flags(parser)
    return parser


def add_submit_flags(parser: argparse.ArgumentParser, target: Optional[str] = None) -> None:
    """The flags of ``submit``; with ``target``, only those of that target (the cloud scripts)."""
    if target is None:
        parser.add_argument("--target", choices=["kubernetes", "azureml", "vertex"], default="kubernetes")
    else:
        parser.set_defaults(target=target)
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="print what would be submitted; submit nothing")
    if target in (None, "kubernetes"):
        parser.add_argument("--follow", action="store_true", help="kubernetes: wait for the pods and stream logs")
        parser.add_argument("--kubectl", default="kubectl", help="kubectl binary (kubernetes target)")
    if target in (None, "azureml"):
        azure = parser.add_argument_group("azureml target")
        azure.add_argument("--subscription_id", help="Azure subscription id")
        azure.add_argument("--resource_group", help="resource group of the workspace (default: the profile's)")
        azure.add_argument("--workspace", help="Azure ML workspace name")
        azure.add_argument("--compute", help="Azure ML compute cluster, or serverless (default: gpu-cluster; with "
                                              "--spot, serverless compute on the Spot tier)")
    if target in (None, "vertex"):
        vertex = parser.add_argument_group("vertex target")
        vertex.add_argument("--project", help="Google Cloud project (default: the profile's)")
        vertex.add_argument("--region", help="Vertex AI region (default: the profile's)")
        vertex.add_argument("--staging_bucket", help="gs:// bucket for outputs (metrics.jsonl under runs/)")
    # A managed service runs no Kubernetes objects of ours: its script does not offer their flags.
    add_spec_flags(parser, exclude=() if target in (None, "kubernetes") else KUBERNETES_ONLY)
    parser.set_defaults(func=run)


# --identity stays: Azure ML runs the job as that managed identity, Vertex AI as that service account.
KUBERNETES_ONLY = ("job", "launcher", "namespace", "storage", "storage_claim", "rdma", "cluster_monitoring",
                   "grace_period_s", "backoff_limit", "model_url", "autoscaler", "gpus", "min_replicas", "max_replicas")


def _require(ns: argparse.Namespace, *names: str) -> None:
    from torchrec_cloud.config import ConfigError

    for name in names:
        if not getattr(ns, name):
            raise ConfigError(name, f"is required for --target {ns.target} (unless --dry-run)")


def submit_kubernetes(spec: DeploySpec, dry_run: bool, follow: bool, kubectl: str = "kubectl") -> int:
    bundle = render_bundle(spec)
    selector = f"{JOB_LABEL}={spec.name}"
    apply_cmd = [kubectl, "apply", "-f", "-"]
    wait_cmd = [kubectl, "wait", "-n", spec.namespace, "--for=condition=Ready", "pod", "-l", selector, "--timeout=60m"]
    pods = spec.nodes
    if spec.job == "serve":  # as many as the autoscaler may run
        pods = spec.max_replicas or load_profile(spec.cloud).serving["max_replicas"]
    logs_cmd = [kubectl, "logs", "-f", "-n", spec.namespace, "-l", selector, "--prefix",
                f"--max-log-requests={pods}", "--tail=-1"]
    if dry_run:
        sys.stdout.write(bundle)
        print(f"# would run: {' '.join(apply_cmd)}  (the YAML above on stdin)", file=sys.stderr)
        print(f"# then watch: {' '.join(logs_cmd)}", file=sys.stderr)
        return 0
    if shutil.which(kubectl) is None:
        raise SubmitError(f"{kubectl!r} not found on PATH: install kubectl and point it at your cluster "
                          "(or use --dry-run / torchrec-cloud render)")
    check_cluster_version(bundle, version_key(spec), kubectl)
    done = subprocess.run(apply_cmd, input=bundle, text=True)
    if done.returncode != 0:
        raise SubmitError(f"kubectl apply failed with exit code {done.returncode}")
    if not follow:
        print(f"submitted; logs: {' '.join(logs_cmd)}")
        if spec.job == "serve" and spec.launcher != "kserve":
            port = load_profile(spec.cloud).serving["port"]
            print(f"serving at http://{spec.name}.{spec.namespace}.svc:{port} in the cluster "
                  f"(kubectl port-forward -n {spec.namespace} svc/{spec.name} {port}:{port} from here)")  # fmt: skip
        return 0
    # Pods appear a moment after the Job; `kubectl wait` fails if none exist yet.
    for _ in range(60):
        pods = subprocess.run([kubectl, "get", "pods", "-n", spec.namespace, "-l", selector, "-o", "name"],
                              capture_output=True, text=True)
        if pods.stdout.strip():
            break
        time.sleep(5)
    subprocess.run(wait_cmd)
    return subprocess.run(logs_cmd).returncode


def cluster_version(kubectl: str = "kubectl") -> tuple[int, int]:
    """(major, minor) of the Kubernetes API server kubectl points at."""
    try:
        done = subprocess.run([kubectl, "version", "-o", "json"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"`{kubectl} version` failed: {e}") from e
    try:
        git_version = json.loads(done.stdout or "{}").get("serverVersion", {}).get("gitVersion", "")
    except (ValueError, AttributeError):
        git_version = ""
    m = re.match(r"v?(\d+)\.(\d+)", git_version or "")
    if not m:
        said = " ".join((done.stderr or done.stdout or "").split())[:300]
        raise SubmitError(f"`{kubectl} version` reported no server version (exit {done.returncode}: {said}): "
                          "is kubectl pointed at your cluster?")  # fmt: skip
    return int(m.group(1)), int(m.group(2))


def version_key(spec: DeploySpec) -> str:
    """The entry of :data:`~torchrec_cloud.deploy.admission.MIN_VERSIONS` the spec's bundle needs."""
    if spec.launcher == "kserve":
        return "kserve"
    if spec.job == "serve":
        return "serve-keda" if spec.autoscaler == "keda" else "serve"
    if spec.job == "daily":
        return "daily"
    return spec.launcher


def check_cluster_version(bundle: str, launcher: str, kubectl: str = "kubectl") -> None:
    """Refuse a cluster older than the Kubernetes version the bundle records it needs
    (``launcher``: its :func:`version_key`)."""
    from torchrec_cloud.deploy.admission import MIN_KUBERNETES_ANNOTATION, MIN_VERSIONS

    needed = next((d["metadata"]["annotations"][MIN_KUBERNETES_ANNOTATION] for d in load_documents(bundle)
                   if MIN_KUBERNETES_ANNOTATION in (d.get("metadata", {}).get("annotations") or {})), None)  # fmt: skip
    if needed is None:
        return
    have = cluster_version(kubectl)
    want = tuple(int(x) for x in needed.split(".")[:2])
    if have < want:
        raise SubmitError(f"the cluster runs Kubernetes {have[0]}.{have[1]}, older than the {needed} a --launcher "
                          f"{launcher} job needs ({MIN_VERSIONS[launcher]['why']}); nothing was applied")  # fmt: skip


def submit_azureml(spec: DeploySpec, ns: argparse.Namespace) -> int:
    from torchrec_cloud.deploy import azureml

    job = azureml.build_command_job(spec, compute=ns.compute)
    if spec.spot and job.compute not in (None, azureml.SERVERLESS, f"azureml:{azureml.SERVERLESS}"):
        print(f"torchrec-cloud submit: note: --spot on compute cluster {ns.compute}: Azure ML takes a job's priority "
              "from its cluster, which must be a low-priority one (az ml compute create --tier low_priority)",
              file=sys.stderr)
    if ns.dry_run:
        sys.stdout.write(azureml.dump_job(job))
        return 0
    resource_group = ns.resource_group or load_profile(spec.cloud).cluster.get("resource_group")
    ns.resource_group = resource_group
    _require(ns, "subscription_id", "resource_group", "workspace")
    created = azureml.submit_job(job, ns.subscription_id, resource_group, ns.workspace)
    print(f"submitted {created.name}: {created.studio_url}")
    return 0


def submit_vertex(spec: DeploySpec, ns: argparse.Namespace) -> int:
    from torchrec_cloud.deploy import vertex

    job = vertex.build_custom_job(spec, staging_bucket=ns.staging_bucket)
    if ns.dry_run:
        print(vertex.dump_job(job))
        return 0
    cluster = load_profile(spec.cloud).cluster
    ns.project = ns.project or cluster.get("project")
    ns.region = ns.region or cluster.get("region")
    _require(ns, "project", "region")
    created = vertex.submit_job(job, ns.project, ns.region)
    print(f"submitted {created.name}")
    return 0


def script_parser(target: str, prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of a cloud script that is ``submit --target TARGET``: its own name and
    description in ``--help``, that target's flags only."""
    from torchrec_cloud.cli import OneLineParser, plain

    parser = OneLineParser(prog=prog, description=plain(description), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_submit_flags(parser, target)
    return parser


def main(argv: list[str], target: str, prog: str, description: str) -> int:
    """``submit --target TARGET`` alone, as the cloud scripts run it (:func:`script_parser`),
    without the other sub-commands' imports."""
    from torchrec_cloud.config import ConfigError

    ns = script_parser(target, prog, description).parse_args(argv)
    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def placeholders(spec: DeploySpec, target: str) -> list[str]:
    """What a real submission of ``spec`` would send that cannot work as it stands: the
    default image (no registry), a profile's example values, a volume nobody created. One
    line each, saying what to pass instead."""
    from torchrec_cloud.deploy.spec import DEFAULT_IMAGE

    profile = load_profile(spec.cloud)
    problems = []
    if spec.image == DEFAULT_IMAGE:
        problems.append(
            f"--image {spec.image} names no registry, so no node can pull it: build docker/Dockerfile.cuda, "
            f"push it and pass --image REGISTRY/{DEFAULT_IMAGE} (docs/deploy.md)"
        )
    identity = profile.identity or {}
    if target == "kubernetes" and identity and spec.identity is None:
        problems.append(
            f"the service account would carry the profile's example identity {identity['example']}: pass "
            f"--identity with your own ({identity['annotation']})"
        )
    for flag, value in (("image", spec.image), ("identity", spec.identity), ("data_url", spec.data_url),
                        ("checkpoint_url", spec.checkpoint_url), ("model_url", spec.model_url)):  # fmt: skip
        example = next((p for p in profile.placeholders if value and p in value), None)
        if example is not None and not (flag == "image" and spec.image == DEFAULT_IMAGE):
            problems.append(f"--{flag} {value} holds the example value {example} of profile {profile.name!r}: "
                            f"pass your own")  # fmt: skip
    from torchrec_cloud.storage import is_url

    served_from_bucket = spec.job == "serve" and spec.model_url is not None and is_url(spec.model_url)
    if target == "kubernetes" and spec.storage and profile.storage and not spec.storage_claim and not served_from_bucket:
        storage = profile.storage
        problems.append(
            f"the job mounts PersistentVolumeClaim {storage['claim_name']} ({storage.get('title', 'shared storage')}), "
            f"which this submission does not create: pass --storage_claim NAME for one that exists in namespace "
            f"{spec.namespace} (`torchrec-cloud render --cloud {profile.name} --what storage` writes one to fill in "
            "and apply), or --no-storage"
        )
    return problems


def run(ns: argparse.Namespace) -> int:
    from torchrec_cloud.config import ConfigError

    spec = spec_from_args(ns)
    if spec.job == "serve" and ns.target != "kubernetes":
        raise ConfigError("job", "--job serve runs a Deployment or a KServe InferenceService: --target kubernetes")
    if spec.job != "train" and ns.target != "kubernetes":
        raise ConfigError("job", f"--job {spec.job} is a Kubernetes Indexed Job: --target kubernetes")
    if not ns.dry_run:
        problems = placeholders(spec, ns.target)
        for problem in problems:
            print(f"torchrec-cloud submit: error: {problem}", file=sys.stderr)
        if problems:
            return 2
    try:
        if ns.target == "kubernetes":
            return submit_kubernetes(spec, ns.dry_run, ns.follow, ns.kubectl)
        if ns.target == "azureml":
            return submit_azureml(spec, ns)
        return submit_vertex(spec, ns)
    except (SubmitError, MissingExtraError) as e:
        print(f"torchrec-cloud submit: error: {e}", file=sys.stderr)
        return 1
