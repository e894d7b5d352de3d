"""What to deploy: one typed description of a distributed training job, cloud-neutral.

:class:`DeploySpec` is what ``torchrec-cloud render`` and ``torchrec-cloud submit`` parse
their flags into; the renderers (Kubernetes manifests, Azure ML, Vertex AI, TorchX) turn a
spec plus a :class:`~torchrec_cloud.deploy.profiles.Profile` into a job. Training flags
(after ``--``) are checked here against the trainer's own config tree, so a manifest never
carries a flag the image's trainer would reject::

    spec = DeploySpec(cloud="generic", nodes=2, gpus_per_node=8, train_args=["--batch_size", "4096"])
    spec.trainer_args("/workspace/runs")   # ['--preset', 'quickstart', '--output_dir', ..., '--batch_size', '4096']
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Optional, Sequence

from torchrec_cloud import __version__, install_extra
from torchrec_cloud.config import PRESETS, ConfigError, FlagParser, add_config_flags, config_from_args, flag_kwargs

LAUNCHERS = ("job", "pytorchjob", "trainjob", "kserve")
JOBS = ("train", "preprocess", "serve", "daily")
AUTOSCALERS = ("hpa", "keda")
DEFAULT_NAME = "torchrec-dlrm"
# `--job preprocess` without --name: a name of its own, so that it and the training job can
# live in one namespace.
PREPROCESS_NAME = "torchrec-preprocess"
SERVE_NAME = "torchrec-serve"
DAILY_NAME = "torchrec-daily"
DEFAULT_IMAGE = f"torchrec-cloud:{__version__}"

# Kubernetes names: DNS-1123 labels. Pod hostnames of an Indexed Job are
# "<name>-<index>", which must stay within 63 characters.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_NAME = 52
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")

# An image reference as the container runtimes parse it: the grammar of
# github.com/distribution/reference regexp.go, as vendored in kubernetes/kubernetes
# (vendor/github.com/distribution/reference/regexp.go at fde22c3f: ReferenceRegexp =
# name [":" tag] ["@" digest]). Python's re has no [[:xdigit:]].
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = _ALNUM + rf"(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[(?:[a-fA-F0-9:]+)\])"
_NAME = rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
# distribution/reference's NameTotalLengthMax.
_MAX_IMAGE_NAME = 255
# Free text that reaches a manifest (a URL, an identity, a training flag): one printable line.
# The templates quote every value as well (manifests.py); this refuses what no URL or flag
# holds, with the flag named, before anything is written.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MAX_TEXT = 4096
# A memory size as a Kubernetes quantity (apimachinery resource.Quantity): a number and a suffix.
_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
MEMORY_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def memory_bytes(value: object) -> Optional[int]:
    """``16Gi`` -> bytes; None for text that is not a memory quantity."""
    m = _MEMORY.match(str(value))
    return round(float(m.group(1)) * MEMORY_UNITS[m.group(2)]) if m else None


def check_image(value: str) -> None:
    """``value`` is an image reference a container runtime would pull (ConfigError naming
    --image otherwise)."""
    match = IMAGE_REFERENCE.fullmatch(value)
    if not match or len(match.group("name")) > _MAX_IMAGE_NAME:
        raise ConfigError(
            "image",
            f"{_shown(value)} is not an image reference: [REGISTRY[:PORT]/]NAME[:TAG][@sha256:DIGEST], "
            "NAME in lower case (e.g. 111122223333.dkr.ecr.us-west-2.amazonaws.com/torchrec-cloud:0.1.0)",
        )


def check_text(flag: str, value: str) -> None:
    """A free-text value (URL, identity, training flag) is one printable line of bounded length."""
    if _UNPRINTABLE.search(value) or len(value) > _MAX_TEXT:
        raise ConfigError(flag, f"must be one line of printable characters (at most {_MAX_TEXT}), "
                                f"got {_shown(value)}")


def _shown(value: str, limit: int = 60) -> str:
    from torchrec_cloud.untrusted import shown

    return f"'{shown(value, limit)}'"


class TrainFlagsError(ConfigError):
    """A training flag (after ``--``) that the trainer would reject."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, f"training flags after '--': {message}")
        self.flag = "--"


class MissingExtraError(ImportError):
    """An optional SDK that is not installed; says which extra brings it."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module} is not installed: {install_extra(extra)}")


class PreprocessFlagsError(ConfigError):
    """A ``data preprocess`` flag (after ``--``, with ``--job preprocess``) it would reject."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, f"data preprocess flags after '--': {message}")
        self.flag = "--"


class _PreprocessFlagParser(FlagParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise PreprocessFlagsError(message)


@lru_cache(maxsize=1)
def _preprocess_parser() -> argparse.ArgumentParser:
    """``data preprocess``'s own parser (from data/cli.py), its errors raised."""
    from torchrec_cloud.data.cli import add_parser

    sub = _PreprocessFlagParser(prog="torchrec-cloud", add_help=False).add_subparsers(parser_class=_PreprocessFlagParser)
    data = add_parser(sub)
    (actions,) = [a for a in data._actions if isinstance(a, argparse._SubParsersAction)]
    return actions.choices["preprocess"]


def preprocess_flags() -> set[str]:
    """Every ``--flag`` of ``data preprocess``."""
    return {s for a in _preprocess_parser()._actions for s in a.option_strings}


class _TrainFlagParser(FlagParser):  # no abbreviations, `_` or `-`, as `train` itself
    def error(self, message: str) -> None:  # type: ignore[override]
        raise TrainFlagsError(message)


@lru_cache(maxsize=1)
def _trainer_parser() -> argparse.ArgumentParser:
    # Built once: its help texts come from the config's source, read with inspect (slow).
    parser = _TrainFlagParser(prog="torchrec-cloud train", add_help=False)
    add_config_flags(parser)
    return parser


def trainer_flags() -> set[str]:
    """Every ``--flag`` the trainer of this checkout accepts."""
    return {s for a in _trainer_parser()._actions for s in a.option_strings}


@dataclass
class DeploySpec:
    """A distributed training job, independent of where it runs."""

    cloud: str = "generic"
    """Profile to fill the templates with (profiles/<cloud>.yaml)."""
    job: Literal["train", "preprocess", "serve", "daily"] = "train"
    """What the pods run: train, or preprocess: `data preprocess --schema` split over --nodes
    pods (an Indexed Job, one share of the inputs each, CPU only), whose flags (--schema,
    --input, --output, --split_by ...) go after '--'; or serve: `torchrec-cloud serve
    --model_url` replicas (a Deployment, Service, autoscaler, PodDisruptionBudget), whose
    `serve` flags go after '--'; or daily: a CronJob whose one pod preprocesses the day, warm-
    starts training from the day before and publishes through the gate (docs/daily.md), whose
    training flags go after '--'."""
    launcher: Literal["job", "pytorchjob", "trainjob", "kserve"] = "job"
    """Indexed Job + headless Service (plain Kubernetes), Kubeflow v1 PyTorchJob, or Kubeflow
    Trainer v2 TrainJob; with --job serve: job (a Deployment) or kserve (a KServe
    InferenceService running the same image)."""
    nodes: int = 1
    """Machines (pods) in the job."""
    gpus_per_node: int = 8
    """GPUs each pod requests; 0 for CPU nodes."""
    procs_per_node: Optional[int] = None
    """Trainer processes per node (default: one per GPU, or 1 on CPU nodes)."""
    instance_type: Optional[str] = None
    """Machine type from the profile (default: the profile's)."""
    gpu_memory: Optional[float] = None
    """Memory of each GPU in GiB, for the plan made before rendering (default: the instance's
    gpu_memory_gb; a cluster with neither is not planned)."""
    plan: bool = True
    """Plan the tables for the cluster first (`torchrec-cloud plan`): refuse a cluster that
    cannot hold the model, and pass the planned --embedding_kernel to the trainer."""
    image: str = DEFAULT_IMAGE
    """Container image built from docker/Dockerfile.cuda (or .cpu)."""
    name: str = DEFAULT_NAME
    """Job name (also the headless Service's and the rendezvous id)."""
    namespace: str = "torchrec"
    """Kubernetes namespace (created by the bundle)."""
    preset: str = "quickstart"
    """Trainer preset; flags after '--' override it."""
    data_url: Optional[str] = None
    """Dataset folder or URL, passed as --dataset_path."""
    checkpoint_url: Optional[str] = None
    """Checkpoint folder or URL, passed as --checkpoint_path."""
    spot: bool = False
    """Run on spot/preemptible nodes (selectors and tolerations from the profile)."""
    storage: bool = True
    """Mount the profile's shared file system (FSx / NetApp / Filestore) if it has one."""
    storage_claim: Optional[str] = None
    """An existing PersistentVolumeClaim to mount as that file system (default: the profile's
    claim, which `render --what storage` writes for you to fill in and apply)."""
    identity: Optional[str] = None
    """Cloud identity for the service account (IAM role ARN, managed identity client id,
    Google service account); default: the profile's example value."""
    rdma: Optional[bool] = None
    """Ask for the instance's RDMA device resource (the profile's rdma_resources), which
    exists only where the cluster's device plugin exposes it (default: the profile's
    request_rdma)."""
    cluster_monitoring: bool = False
    """Also render the metrics collector's cluster-wide configuration where the profile's
    collector needs one (EKS: the CloudWatch agent's two ConfigMaps, which replace its
    configuration for the whole cluster)."""
    shm_size: Optional[str] = None
    """Size of /dev/shm (default: the profile's)."""
    grace_period_s: Optional[int] = None
    """Seconds between SIGTERM and SIGKILL, for the checkpoint (default: the profile's)."""
    backoff_limit: Optional[int] = None
    """Pod failures tolerated, preemptions excluded (default: the profile's, per node; a
    PyTorchJob has none: docs/deploy.md)."""
    reclaim_grace_s: Optional[int] = None
    """With --spot: seconds a reclaim leaves the pods before SIGKILL, which they are told
    (TORCHREC_CLOUD_GRACE_S) to decide whether a save on SIGTERM fits (default: the profile's
    spot.reclaim_grace_s)."""
    peer_timeout_s: Optional[int] = None
    """Seconds without a peer pod's heartbeat before a pod counts it lost and exits 200 to
    be started again (launch --peer_timeout_s; default: the profile's; 0: no heartbeats, and
    a lost peer costs --pg_timeout_s)."""
    model_url: Optional[str] = None
    """With --job serve: the model to serve, a model folder or a published root (export
    --publish; the replicas follow its `current`), a bucket URL or a path on the mounted storage."""
    autoscaler: Literal["hpa", "keda"] = "hpa"
    """With --job serve: a HorizontalPodAutoscaler on CPU, or a KEDA ScaledObject on the
    replicas' in-flight requests (a Prometheus query)."""
    gpus: Optional[int] = None
    """With --job serve: GPUs per replica (default 0: CPU replicas; training takes --gpus_per_node)."""
    min_replicas: Optional[int] = None
    """With --job serve: fewest replicas (default: the profile's serving.min_replicas)."""
    max_replicas: Optional[int] = None
    """With --job serve: most replicas (default: the profile's serving.max_replicas)."""
    schedule: str = "0 2 * * *"
    """With --job daily: when the day's job starts (a cron schedule, in the CronJob's --time_zone)."""
    time_zone: str = "Etc/UTC"
    """With --job daily: the time zone of --schedule (an IANA name)."""
    train_args: list[str] = field(default_factory=list)
    """Trainer flags, e.g. ['--batch_size', '4096'] (with --job preprocess: `data preprocess` flags;
    with --job serve: `serve` flags)."""

    def __post_init__(self) -> None:
        if self.job not in JOBS:
            raise ConfigError("job", f"must be one of {', '.join(JOBS)}, got {self.job!r}")
        if self.launcher not in LAUNCHERS:
            raise ConfigError("launcher", f"must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.job == "preprocess" and self.name == DEFAULT_NAME:
            self.name = PREPROCESS_NAME
        if self.job == "serve" and self.name == DEFAULT_NAME:
            self.name = SERVE_NAME
        if self.job == "daily" and self.name == DEFAULT_NAME:
            self.name = DAILY_NAME
        if self.autoscaler not in AUTOSCALERS:
            raise ConfigError("autoscaler", f"must be one of {', '.join(AUTOSCALERS)}, got {self.autoscaler!r}")
        if self.nodes < 1:
            raise ConfigError("nodes", f"must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError("gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        if self.gpu_memory is not None and self.gpu_memory <= 0:
            raise ConfigError("gpu_memory", f"must be > 0 (GiB), got {self.gpu_memory}")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise ConfigError("procs_per_node", f"must be >= 1, got {self.procs_per_node}")
        if self.gpus_per_node and self.procs_per_node and self.procs_per_node != self.gpus_per_node:
            raise ConfigError(
                "procs_per_node",
                f"with GPUs each process drives one GPU: must equal --gpus_per_node "
                f"({self.gpus_per_node}), got {self.procs_per_node}",
            )
        for flag, value in (("name", self.name), ("namespace", self.namespace)):
            if not _DNS_LABEL.match(value) or len(value) > _MAX_NAME:
                raise ConfigError(
                    flag,
                    f"must be lower-case letters, digits and '-', start and end with a letter "
                    f"or digit, at most {_MAX_NAME} characters; got {value!r}",
                )
        if self.preset not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(sorted(PRESETS))}, got {self.preset!r}")
        if self._trains_with("--preset"):
            # The job's preset decides its plan and what the guides' scripts add; one among the
            # training flags would silently override the --preset this job was rendered with.
            raise ConfigError("preset", "give the preset before '--' (--preset NAME), not among the training flags")
        if not self.image.strip():
            raise ConfigError("image", "must not be empty")
        check_image(self.image)
        for flag in ("data_url", "checkpoint_url", "identity", "model_url"):
            if getattr(self, flag) is not None:
                check_text(flag, getattr(self, flag))
        for arg in self.train_args:
            if _UNPRINTABLE.search(arg) or len(arg) > _MAX_TEXT:
                raise TrainFlagsError(f"{_shown(arg)} is not one line of printable characters")
        if self.shm_size is not None and memory_bytes(self.shm_size) is None:
            raise ConfigError("shm_size", f"must be a size such as 8Gi or 512Mi, got {_shown(self.shm_size)}")
        if self.grace_period_s is not None and self.grace_period_s < 60:
            raise ConfigError(
                "grace_period_s",
                f"must be >= 60 (the trainer finishes a step and writes a checkpoint), got {self.grace_period_s}",
            )
        if self.backoff_limit is not None and self.backoff_limit < 0:
            raise ConfigError("backoff_limit", f"must be >= 0, got {self.backoff_limit}")
        if self.reclaim_grace_s is not None and self.reclaim_grace_s < 1:
            raise ConfigError("reclaim_grace_s", f"must be >= 1 (seconds), got {self.reclaim_grace_s}")
        if self.peer_timeout_s is not None and self.peer_timeout_s < 0:
            raise ConfigError("peer_timeout_s", f"must be >= 0 (seconds; 0: no heartbeats), got {self.peer_timeout_s}")
        if self.storage_claim is not None and not _DNS_SUBDOMAIN.match(self.storage_claim):
            raise ConfigError("storage_claim", f"must be a PersistentVolumeClaim name, got {self.storage_claim!r}")
        if self.job == "serve":
            self._check_serve()
            return
        for flag in ("model_url", "gpus", "min_replicas", "max_replicas"):
            if getattr(self, flag) is not None:
                raise ConfigError(flag, "applies to --job serve" + ("; training takes --gpus_per_node" if flag == "gpus" else ""))
        if self.launcher == "kserve":
            raise ConfigError("launcher", "kserve applies to --job serve")
        if self.job != "daily" and (self.schedule, self.time_zone) != ("0 2 * * *", "Etc/UTC"):
            raise ConfigError("schedule" if self.schedule != "0 2 * * *" else "time_zone", "applies to --job daily")
        if self.job == "preprocess":
            self._check_preprocess()
        elif self.job == "daily":
            self._check_daily()
        elif self.spot and not self.checkpoint_url and not self._trains_with("--checkpoint_path"):
            raise ConfigError(
                "checkpoint_url",
                "--spot needs a checkpoint destination: a reclaimed node's pods resume from the last "
                f"checkpoint (--checkpoint_every_s); pass --checkpoint_url {self._checkpoint_examples()}",
            )

    def _check_serve(self) -> None:
        """A serving job: a model to serve, replicas within bounds, `serve` flags after '--'
        that the placement does not own."""
        if self.launcher not in ("job", "kserve"):
            raise ConfigError("launcher", f"--job serve runs a Deployment (job) or a KServe InferenceService "
                                          f"(kserve), got {self.launcher!r}")  # fmt: skip
        if not self.model_url:
            raise ConfigError("model_url", "--job serve needs the model: a model folder or published root "
                                           "(URL, or a path on the mounted storage)")  # fmt: skip
        for flag in ("data_url", "checkpoint_url"):
            if getattr(self, flag):
                raise ConfigError(flag, "applies to --job train; --job serve takes --model_url")
        self.gpus = self.gpus or 0
        if self.gpus < 0:
            raise ConfigError("gpus", f"must be >= 0, got {self.gpus}")
        for flag in ("min_replicas", "max_replicas"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                raise ConfigError(flag, f"must be >= 1, got {value}")
        if self.min_replicas and self.max_replicas and self.min_replicas > self.max_replicas:
            raise ConfigError("max_replicas", f"must be >= --min_replicas ({self.min_replicas}), got {self.max_replicas}")
        owned = {"--host", "--port", "--name"}
        given = sorted({a.split("=", 1)[0] for a in self.train_args} & owned)
        if given:
            raise ConfigError("--", f"serve flags after '--': {given[0]} is the manifest's own "
                                    "(the Service and probes use it)")  # fmt: skip
        workers = self.serve_workers()
        if workers is not None and workers < 1:
            raise ConfigError("--", f"serve flags after '--': --workers must be >= 1, got {workers}")

    def serve_workers(self) -> Optional[int]:
        """``--workers N`` among the `serve` flags after '--', if given."""
        for group in _flag_groups(list(self.train_args)):
            flag, _, value = group[0].partition("=")
            if flag == "--workers":
                value = value or (group[1] if len(group) > 1 else "")
                try:
                    return int(value)
                except ValueError:
                    raise ConfigError("--", f"serve flags after '--': --workers takes a whole number, got "
                                            f"{value!r}") from None  # fmt: skip
        return None

    def _check_daily(self) -> None:
        """The daily job: one pod of a CronJob (the day's preprocessing, warm training, the gated
        publish, one after the other), on a schedule."""
        if self.launcher != "job" or self.nodes != 1:
            raise ConfigError("nodes" if self.nodes != 1 else "launcher", "--job daily runs its steps in one pod of a "
                              "CronJob: --launcher job --nodes 1 (its training uses that pod's GPUs)")  # fmt: skip
        fields = self.schedule.split()
        if len(fields) != 5 or not all(re.fullmatch(r"[0-9*/,\-A-Za-z?]+", f) for f in fields):
            raise ConfigError("schedule", f"must be a cron schedule of 5 fields (minute hour day month weekday), "
                              f"got {_shown(self.schedule)}")  # fmt: skip
        if not re.fullmatch(r"[A-Za-z0-9_+\-]+(/[A-Za-z0-9_+\-]+)*", self.time_zone):
            raise ConfigError("time_zone", f"must be an IANA time zone name such as Etc/UTC, got {_shown(self.time_zone)}")
        for flag in ("data_url", "checkpoint_url"):
            if getattr(self, flag):
                raise ConfigError(flag, "applies to --job train; the daily job keeps its days under the shared "
                                  "storage's daily/ folder (docs/daily.md)")  # fmt: skip
        for owned in ("--dataset_path", "--checkpoint_path", "--output_dir", "--warm_start", "--resume_from"):
            if self._trains_with(owned):
                raise TrainFlagsError(f"{owned}: the daily job sets it for each day (docs/daily.md)")

    def _check_preprocess(self) -> None:
        """A preprocessing job: an Indexed Job of --nodes pods (or --shares N among its flags),
        whose `data preprocess` flags the command itself accepts."""
        if self.launcher != "job":
            raise ConfigError("launcher", f"--job preprocess is an Indexed Job: --launcher job, got {self.launcher!r}")
        for flag in ("data_url", "checkpoint_url"):
            if getattr(self, flag):
                raise ConfigError(flag, "applies to --job train; give the inputs and output after '--' "
                                  "(-- --schema FILE --input URL... --output URL)")  # fmt: skip
        ns = _preprocess_parser().parse_args(list(self.train_args))
        if (ns.schema is None) == (ns.format is None):
            raise PreprocessFlagsError("--job preprocess needs --schema FILE (your data: a URL or a path on the "
                                       "mounted storage, as the pods read it) or --format kaggle|terabyte (Criteo), "
                                       "one of them")  # fmt: skip
        if ns.output is None:
            raise PreprocessFlagsError("--output is required: the folder or URL every pod writes to")
        if ns.share_index is not None:
            raise PreprocessFlagsError("--share_index: each pod's share is its JOB_COMPLETION_INDEX")
        if ns.shares is not None:
            if ns.shares < 1:
                raise PreprocessFlagsError(f"--shares must be >= 1, got {ns.shares}")
            if self.nodes not in (1, ns.shares):
                raise ConfigError("nodes", f"--nodes {self.nodes} and --shares {ns.shares} disagree: one pod per share")
            self.nodes = ns.shares

    def preprocess_args(self, workers: int) -> list[str]:
        """``data preprocess`` flags of each pod: the user's (those after '--', without
        --shares), then ``--shares NODES`` and ``--workers`` (the pod's CPUs, unless given)."""
        groups = [g for g in _flag_groups(list(self.train_args)) if g[0].split("=", 1)[0] != "--shares"]
        args = [w for g in groups for w in g] + ["--shares", str(self.nodes)]
        if not any(g[0].split("=", 1)[0] == "--workers" for g in groups):
            args += ["--workers", str(workers)]
        return args

    def _checkpoint_examples(self) -> str:
        """Where this cloud's checkpoints can go, in its own URL schemes."""
        from torchrec_cloud.deploy.profiles import load_profile

        profile = load_profile(self.cloud)
        store = f"{profile.object_store}/checkpoints" if profile.object_store else "URL (s3://, gs://, az://)"
        text = f"{store} (or a folder on the shared file system)"
        managed = profile.managed_training or {}
        if managed.get("checkpoint_example") and not managed["checkpoint_example"].startswith(store.split("//")[0]):
            text += f"; on {managed['service']}: {managed['checkpoint_example']}"
        return text

    def _trains_with(self, flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in self.train_args)

    @property
    def procs(self) -> int:
        """Trainer processes per node."""
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs

    def user_prometheus_port(self) -> Optional[int]:
        """``--prometheus_port`` given among the training flags, if any (it then decides the
        ports the manifests declare and the collectors scrape)."""
        return getattr(_trainer_parser().parse_args(list(self.train_args)), "prometheus_port", None)

    def trainer_args(self, output_root: str, metrics_args: Sequence[str] = ()) -> list[str]:
        """Flags for ``torchrec-cloud train``: preset, data, checkpoint, output, the flags of
        ``metrics_args`` (the metrics endpoint's ``--prometheus_port``/``--prometheus_linger``
        from the monitoring profile, the plan's ``--embedding_kernel``, a spot job's
        checkpoint cadence), then the user's, which win: a flag the user gives (or its
        ``--no-`` form) is not added.
        Raises :class:`ConfigError` if the combined flags would not start the trainer.
        """
        known = trainer_flags()
        user = list(self.train_args)
        user_flags = {a.split("=", 1)[0].replace("--no-", "--") for a in user if a.startswith("--")}
        args = ["--preset", self.preset]
        if self.data_url:
            args += ["--dataset_path", self.data_url]
        if self.checkpoint_url:
            if "--checkpoint_path" not in known:
                raise ConfigError(
                    "checkpoint_url", "this trainer has no --checkpoint_path flag (checkpointing not built in)"
                )
            args += ["--checkpoint_path", self.checkpoint_url]
        if "--output_dir" not in user_flags:
            args += ["--output_dir", f"{output_root}/{self.name}"]
        for group in _flag_groups(list(metrics_args)):
            if group[0] not in user_flags:
                args += group
        args += user
        ns = _trainer_parser().parse_args(args)
        cfg = config_from_args(ns)  # raises ConfigError naming the flag for bad values
        cfg.sharding.check_device("cuda" if self.gpus_per_node else "cpu")
        return args


def _flag_groups(argv: list[str]) -> list[list[str]]:
    """``["--a", "1", "--b", "--c", "x"]`` -> ``[["--a", "1"], ["--b"], ["--c", "x"]]``."""
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def add_spec_flags(
    parser: argparse.ArgumentParser, defaults: Optional[dict] = None, exclude: Sequence[str] = ()
) -> None:
    """One flag per :class:`DeploySpec` field (``--nodes``, ``--spot``, ...; not those in
    ``exclude``) plus the training flags after ``--``."""
    import dataclasses
    import typing

    from torchrec_cloud.config import _field_docs

    defaults = defaults or {}
    docs = _field_docs(DeploySpec)
    hints = typing.get_type_hints(DeploySpec)
    for f in dataclasses.fields(DeploySpec):
        if f.name == "train_args" or f.name in exclude:
            continue
        tp = hints[f.name]
        kwargs: dict = {"help": docs.get(f.name, ""), **flag_kwargs(tp)}
        default = defaults.get(f.name, f.default)
        if f.name == "cloud":
            from torchrec_cloud.deploy.profiles import profile_names

            kwargs["help"] = f"profile: {', '.join(profile_names())}, or a path to your own .yaml"
        if f.name == "preset":
            kwargs["choices"] = sorted(PRESETS)
        kwargs["default"] = default
        if default is not None and not isinstance(default, bool):
            kwargs["help"] += f" (default: {default})"
        parser.add_argument(f"--{f.name}", **kwargs)
    parser.add_argument(
        "train_args",
        nargs="*",
        metavar="-- TRAINING FLAGS",
        help="flags for `torchrec-cloud train` after a lone '--' (e.g. -- --batch_size 4096); with --job "
        "preprocess, for `data preprocess` (-- --schema FILE --input URL... --output URL)",
    )


def spec_from_args(ns: argparse.Namespace) -> DeploySpec:
    import dataclasses

    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(DeploySpec) if hasattr(ns, f.name)}
    values["train_args"] = list(ns.train_args or [])
    return DeploySpec(**values)
