"""Kubernetes manifests from one set of Jinja2 templates and a cloud profile.

:func:`build_context` turns a :class:`DeploySpec` and a :class:`Profile` into plain values
(labels, node selector, env, volumes, the `torchrec-cloud launch` command); the templates in
``templates/`` only lay them out. Each launcher is a list of templates::

    job         Namespace, ServiceAccount, headless Service, Indexed Job, NetworkPolicy
    --job preprocess: Namespace, ServiceAccount, Indexed Job of `data preprocess` pods, NetworkPolicy
    --job serve: Namespace, ServiceAccount, Deployment, Service, autoscaler, PodDisruptionBudget,
                 NetworkPolicy; or a KServe InferenceService (deploy/serving.py)
    pytorchjob  Namespace, ServiceAccount, Kubeflow v1 PyTorchJob, NetworkPolicy
    trainjob    Namespace, ServiceAccount, Kubeflow Trainer v2 TrainingRuntime + TrainJob, NetworkPolicy

Every pod meets the restricted Pod Security Standard, with cpu and memory requested and
capped, and the job's NetworkPolicy admits only its own pods and its metrics collector
(docs/security.md); every text value is printed quoted (``| q``) or as dumped YAML.

Every bundle passes :mod:`torchrec_cloud.deploy.admission` (the API server's and the
operators' webhooks' rules) before it is returned, and records the versions it needs.
Followed by the objects the cluster's metrics collector needs (the profile's ``monitoring``
key picks them from :func:`torchrec_cloud.deploy.monitoring.monitoring_profile`, which also
gives the pod labels, annotations, metrics container ports and trainer flags)::

    text = render_bundle(DeploySpec(cloud="generic", nodes=2, gpus_per_node=8))
    docs = list(yaml.safe_load_all(text))
"""

from __future__ import annotations

import json
import re
import shlex
from functools import lru_cache
from typing import Any, Optional

import jinja2
import yaml
from markupsafe import Markup

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.profiles import Profile, ProfileError, load_profile
from torchrec_cloud.deploy.pod import (  # noqa: F401 (JOB_LABEL, SERVICE_ACCOUNT: others import them from here)
    JOB_LABEL,
    SERVICE_ACCOUNT,
    _bytes,
    _cpu_text,
    _memory_text,
    _millicores,
    _network_policy,
    _resources,
    workload_context,
)
from torchrec_cloud.deploy.spec import DeploySpec

LAUNCHER_TEMPLATES = {
    "job": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "service.yaml.j2", "job.yaml.j2", "networkpolicy.yaml.j2"],
    "pytorchjob": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "pytorchjob.yaml.j2", "networkpolicy.yaml.j2"],
    # A TrainJob cannot set its JobSet's failure policy or its Job's podFailurePolicy (its
    # runtimePatches take pod metadata and a few container fields): the bundle carries a
    # TrainingRuntime of its own, which can.
    "trainjob": ["namespace.yaml.j2", "serviceaccount.yaml.j2", "trainingruntime.yaml.j2", "trainjob.yaml.j2",
                 "networkpolicy.yaml.j2"],
}
# `--job preprocess`: an Indexed Job of `data preprocess` pods (no Service: they never talk).
PREPROCESS_TEMPLATES = ["namespace.yaml.j2", "serviceaccount.yaml.j2", "preprocess_job.yaml.j2", "networkpolicy.yaml.j2"]
# `--job daily`: a CronJob whose one pod runs the day's steps (daily.sh.j2).
DAILY_TEMPLATES = ["namespace.yaml.j2", "serviceaccount.yaml.j2", "daily_cronjob.yaml.j2", "networkpolicy.yaml.j2"]
# The pods' annotation with the plan made before rendering (`kubectl describe pod`).
PLAN_ANNOTATION = "torchrec-cloud/plan"
# The seconds between SIGTERM and SIGKILL a pod can count on (the trainer's
# --sigterm_grace_s): a spot job's reclaim grace, else its terminationGracePeriodSeconds.
GRACE_ENV = "TORCHREC_CLOUD_GRACE_S"


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (config files inside ConfigMaps) as readable ``|`` blocks."""


def _str_block(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_block)


class Placed(str):
    """Text a filter made safe for the place it is printed: a quoted YAML scalar, a YAML block,
    a shell word. Everything else a template prints must hold no line break (``_finalize``)."""


def _placed(fn):
    return lambda *args, **kw: Placed(fn(*args, **kw))


def _dump(value: Any) -> str:
    return yaml.dump(value, Dumper=_BlockDumper, default_flow_style=False, sort_keys=False, width=1000).rstrip("\n")


def _nindent(value: Any, indent: int) -> str:
    """A value after ``key:``: inline ``{}``/``[]`` when empty, else an indented block."""
    if not value:
        return " []" if isinstance(value, list) else " {}"
    pad = " " * indent
    return "\n" + "\n".join(pad + line for line in _dump(value).splitlines())


def _yaml_block(value: Any, indent: int) -> str:
    """A mapping's keys laid out at ``indent`` (for splicing keys into a parent mapping)."""
    if not value:
        return ""
    pad = " " * indent
    return "\n".join(pad + line for line in _dump(value).splitlines())


def _quoted(value: Any) -> str:
    """``value`` as one double-quoted scalar (JSON's string syntax is YAML's): whatever it holds,
    it stays the value of its key and can add none."""
    return json.dumps(str(value))


# Line breaks as YAML, a shell or a Dockerfile see them.
_LINE_BREAK = re.compile(r"[\r\n\x0b\x0c\x85\u2028\u2029]")


def _wordwrap(env: jinja2.Environment, value: str, width: int, wrapstring: str = "\n", **kw: Any) -> str:
    """Jinja's wordwrap for prose in comments: the breaks are the template's (``wrapstring``),
    never the value's own."""
    from jinja2.filters import do_wordwrap

    return Placed(do_wordwrap(env, " ".join(_LINE_BREAK.split(str(value))), width, wrapstring=wrapstring, **kw))


def _shell_word(value: Any) -> str:
    """``value`` inside a double-quoted shell word (``"${X:-{{ v | shword }}}"``), where quotes
    of its own would be literal: only text that needs no quoting is let through."""
    text = str(value)
    if not text or shlex.quote(text) != text:
        raise ConfigError("cloud", f"a profile value printed in a shell script must be letters, digits and "
                                   f"@%+=:,./-_, got '{text}'")  # fmt: skip
    return text


def _finalize(value: Any) -> Any:
    """Every ``{{ }}`` of every template: a value printed as it is may not break a line (in a
    YAML comment or plain scalar, a shell script or a Dockerfile the next line would be its
    own key or command). Values meant to span lines go through a filter that places them."""
    if isinstance(value, str) and not isinstance(value, (Placed, Markup)) and _LINE_BREAK.search(value):
        from torchrec_cloud.untrusted import shown

        raise ConfigError("cloud", f"a profile value holds a line break where a template prints it as it is: "
                                   f"'{shown(value, 60)}'")  # fmt: skip
    return value


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("torchrec_cloud.deploy", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        autoescape=False,
        finalize=_finalize,
    )
    env.filters["nindent"] = _placed(_nindent)
    env.filters["yaml_block"] = _placed(_yaml_block)
    env.filters["toyaml"] = _placed(_dump)
    # Every text value of a YAML template: `key: {{ value | q }}`.
    env.filters["q"] = _placed(_quoted)
    env.filters["shquote"] = _placed(shlex.quote)
    env.filters["shword"] = _placed(_shell_word)
    env.filters["json"] = _placed(lambda value: json.dumps(value, separators=(",", ":")))
    env.filters["wordwrap"] = jinja2.pass_environment(_wordwrap)
    # Text a template wrote itself, passed on (a macro's `caller()` body): no value of ours in it.
    env.filters["template_text"] = _placed(str)
    env.filters["taint"] = lambda t: f"{t['key']}={t.get('value', '')}:{t['effect']}"
    return env


def render_template(template: str, /, **context: Any) -> str:
    return environment().get_template(template).render(**context)


# Every launcher starts the trainer through `torchrec-cloud launch` (torchrun with exit codes
# the controllers act on: 0 only for a finished run, EXIT_PREEMPTED for a preemption).
LAUNCH_COMMAND = ["torchrec-cloud", "launch"]
PREPROCESS_COMMAND = ["torchrec-cloud", "data", "preprocess"]


def spot_train_args(spec: DeploySpec, profile: Profile) -> list[str]:
    """A spot job's trainer flags, on every target (Kubernetes, Azure ML, Vertex AI, TorchX):
    it saves on a clock (``spot.checkpoint_every_s``), in the background, since a reclaim's
    grace is too short for a large model's save; the user's own flags win (``trainer_args``)."""
    if not spec.spot:
        return []
    return ["--checkpoint_every_s", str(profile.spot["checkpoint_every_s"]), "--async_checkpoint"]


def build_context(spec: DeploySpec, profile: Optional[Profile] = None) -> dict[str, Any]:
    """Every value the templates use, computed from the spec and the profile's data."""
    from torchrec_cloud.launch import EXIT_CONFIG, EXIT_PREEMPTED

    profile = profile or load_profile(spec.cloud)
    if spec.job == "preprocess":
        return preprocess_context(spec, profile)
    if spec.job == "daily":
        return daily_context(spec, profile)
    if spec.job == "serve":
        from torchrec_cloud.deploy.serving import serve_context

        return serve_context(spec, profile)
    instance = _instance(spec, profile)
    grace = spec.grace_period_s or profile.termination_grace_period_s
    workload = workload_context(spec, profile, instance, grace)
    metrics_port = spec.user_prometheus_port() or profile.metrics_port
    monitoring = _monitoring(spec, profile, metrics_port)
    output_root = workload["output_root"]
    spot_args = spot_train_args(spec, profile)
    trainer_args = spec.trainer_args(output_root, [*monitoring.container_args, *spot_args])
    plan, planned_args = _plan(spec, profile, instance, trainer_args)
    if planned_args:
        trainer_args = spec.trainer_args(output_root, [*monitoring.container_args, *spot_args, *planned_args])
    launch = _launch_args(spec, profile, grace, trainer_args)
    env = {**profile.env, **(instance.env if instance is not None else {})}
    env_grace = min(grace, spec.reclaim_grace_s or profile.reclaim_grace_s()) if spec.spot else grace
    env[GRACE_ENV] = env_grace
    identity = profile.identity or {}
    labels = workload["labels"]

    ctx: dict[str, Any] = {
        **workload,
        "procs": spec.procs,
        "world_size": spec.world_size,
        "pod_labels": {**labels, **identity.get("pod_labels", {}), **monitoring.pod_labels, **profile.pod_labels},
        "pod_annotations": {**monitoring.pod_annotations, **profile.pod_annotations,
                            **({PLAN_ANNOTATION: plan["summary"]} if plan else {})},
        "env": [{"name": k, "value": str(v)} for k, v in env.items()],
        "resources": _resources(spec, profile, instance, workload["rdma"]),
        "network_policy": _network_policy(spec, profile, monitoring, metrics_port, workload["selector"], labels),
        "backoff_limit": spec.backoff_limit if spec.backoff_limit is not None else profile.backoff_limit,
        "max_restarts": profile.max_restarts,
        "rendezvous_port": profile.rendezvous_port,
        "rendezvous_endpoint": f"{spec.name}-0.{spec.name}:{profile.rendezvous_port}",
        "join_timeout_s": profile.rendezvous_join_timeout_s,
        "shutdown_timeout_s": launch["shutdown_timeout_s"],
        "grace_period_s": grace,
        "env_grace_s": env_grace,
        "metrics_port": metrics_port,
        "monitoring": monitoring,
        "trainer_args": trainer_args,
        "plan": plan,
        "planned_args": planned_args,
        "spot_args": spot_args,
        "launch_command": LAUNCH_COMMAND,
        "job_launch_args": launch["job"],
        "operator_launch_args": launch["pytorchjob"],
        "trainjob_launch_args": launch["trainjob"],
        "exit_preempted": EXIT_PREEMPTED,
        "exit_config": EXIT_CONFIG,
    }
    ctx["container_spec"] = _container_spec(ctx, ports=_ports(spec, profile, monitoring))
    return ctx


def preprocess_context(spec: DeploySpec, profile: Profile) -> dict[str, Any]:
    """``--job preprocess``: ``data preprocess`` over ``spec.nodes`` pods of an Indexed Job,
    one share of the inputs each (its JOB_COMPLETION_INDEX), on CPU nodes: the profile's
    ``preprocess`` requests and limits, no GPU; the storage, identity and image of training."""
    grace = spec.grace_period_s or profile.termination_grace_period_s
    # Shares are independent: several may share a node.
    ctx = workload_context(spec, profile, None, grace, one_per_node=False)
    settings = profile.preprocess
    shm = spec.shm_size or settings.get("shm_size") or profile.shm_size
    for volume in ctx["volumes"]:
        if volume["name"] == "dshm":
            volume["emptyDir"]["sizeLimit"] = shm
    resources = _preprocess_resources(profile, shm)
    # --workers: the whole CPUs of the request, at least 1.
    cpus = _millicores(settings["requests"]["cpu"], f"profile {profile.name!r}, preprocess") // 1000
    args = spec.preprocess_args(workers=max(cpus, 1))
    ctx.update({"env": [], "resources": resources, "preprocess_command": PREPROCESS_COMMAND, "preprocess_args": args})
    return _closed_pod(ctx, spec, profile)


def daily_context(spec: DeploySpec, profile: Profile) -> dict[str, Any]:
    """``--job daily``: a CronJob of one pod, on the training instance (its GPUs, requests and
    storage), running :func:`daily_script`; its days under ``OUTPUT_ROOT/daily``."""
    from torchrec_cloud.serving.publish import DEFAULT_TOLERANCE

    instance = _instance(spec, profile)
    grace = spec.grace_period_s or profile.termination_grace_period_s
    ctx = workload_context(spec, profile, instance, grace)
    root = f"{ctx['output_root']}/daily"
    env = {**profile.env, **(instance.env if instance is not None else {}), GRACE_ENV: grace,
           "DAILY_ROOT": root, "DAILY_SCHEMA": f"{root}/schema.yaml", "DAILY_INPUT": f"{root}/input"}  # fmt: skip
    train = ["torchrec-cloud", "train"] if spec.procs == 1 else \
        [*LAUNCH_COMMAND, "--standalone", f"--nproc_per_node={spec.procs}", "-m", "torchrec_cloud", "train"]  # fmt: skip
    script = render_template("daily.sh.j2", train_command=train, train_args=["--preset", spec.preset, *spec.train_args],
                             tolerance=DEFAULT_TOLERANCE)  # fmt: skip
    from torchrec_cloud.deploy.admission import MIN_KUBERNETES_ANNOTATION, MIN_VERSIONS

    ctx.update({
        "workload_annotations": {MIN_KUBERNETES_ANNOTATION: MIN_VERSIONS["daily"]["kubernetes"]},
        "daily_root": root,
        "daily_script": script,
        "daily_command": ["bash", "-c", script],
        "env": [{"name": k, "value": str(v)} for k, v in env.items()],
        "resources": _resources(spec, profile, instance, ctx["rdma"]),
    })  # fmt: skip
    return _closed_pod(ctx, spec, profile)


def _closed_pod(ctx: dict[str, Any], spec: DeploySpec, profile: Profile) -> dict[str, Any]:
    """What a pod of one of the jobs nothing connects to (a preprocessing share, the daily
    job) takes from the profile: its labels and annotations, the backoff limit, the exit code
    of a refused configuration, no monitoring and no ingress at all."""
    from torchrec_cloud.launch import EXIT_CONFIG

    identity = profile.identity or {}
    ctx.update({
        "pod_labels": {**ctx["labels"], **identity.get("pod_labels", {}), **profile.pod_labels},
        "pod_annotations": dict(profile.pod_annotations),
        "backoff_limit": spec.backoff_limit if spec.backoff_limit is not None else profile.backoff_limit,
        "exit_config": EXIT_CONFIG,
        "monitoring": None,
        "network_policy": _network_policy(spec, profile, None, 0, ctx["selector"], ctx["labels"], peers=False),
    })  # fmt: skip
    ctx["container_spec"] = _container_spec(ctx, ports=[])
    return ctx


def _preprocess_resources(profile: Profile, shm: str) -> dict[str, Any]:
    """The profile's ``preprocess`` requests, limits defaulting to them, and /dev/shm added to
    the memory limit (it counts against it, as in :func:`_resources`)."""
    where = f"profile {profile.name!r}, preprocess"
    settings = profile.preprocess
    requests = {"cpu": _millicores(settings["requests"]["cpu"], where),
                "memory": _bytes(settings["requests"]["memory"], "cloud", where)}
    limits = dict(requests)
    given = settings.get("limits") or {}
    if "cpu" in given:
        limits["cpu"] = _millicores(given["cpu"], where)
    if "memory" in given:
        limits["memory"] = _bytes(given["memory"], "cloud", where)
    limits["memory"] += _bytes(shm, "shm_size", "/dev/shm size")
    return {"requests": {"cpu": _cpu_text(requests["cpu"]), "memory": _memory_text(requests["memory"])},
            "limits": {"cpu": _cpu_text(limits["cpu"]), "memory": _memory_text(limits["memory"])}}


def _plan(spec: DeploySpec, profile: Profile, instance, trainer_args: list[str]) -> tuple[Optional[dict], list[str]]:
    """TorchRec's plan for the job's GPUs (``torchrec-cloud plan``; raises ``DoesNotFit``
    when the cluster cannot hold the model) and the trainer flags it adds: the planned
    ``--embedding_kernel``, unless the user gave one."""
    from torchrec_cloud.plan import deploy_plan

    plan = deploy_plan(spec, profile, instance, trainer_args)
    return plan, (["--embedding_kernel", plan["kernel_flag"]] if plan else [])


def _instance(spec: DeploySpec, profile: Profile):
    wants_instance = spec.instance_type is not None or spec.gpus_per_node > 0
    instance = profile.instance(spec.instance_type) if wants_instance else None
    if instance is not None and instance.gpus and spec.gpus_per_node > instance.gpus:
        raise ConfigError(
            "gpus_per_node", f"{instance.name} has {instance.gpus} GPUs, asked for {spec.gpus_per_node}"
        )
    return instance


def _ports(spec: DeploySpec, profile: Profile, monitoring) -> list[dict[str, Any]]:
    ports = list(monitoring.container_ports)
    if spec.launcher == "job":
        # The operators pick their own rendezvous ports; the Indexed Job uses this one.
        ports.append({"name": "rendezvous", "containerPort": profile.rendezvous_port, "protocol": "TCP"})
    return ports


def _container_spec(ctx: dict[str, Any], ports: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {"ports": ports} if ports else {}
    container["resources"] = ctx["resources"]
    container["securityContext"] = ctx["container_security"]
    container["volumeMounts"] = ctx["volume_mounts"]
    return container


def _launch_args(spec: DeploySpec, profile: Profile, grace: int, trainer_args: list[str]) -> dict[str, Any]:
    """`torchrec-cloud launch` flags per launcher. The Indexed Job names the whole rendezvous;
    PyTorchJob's operator sets PET_NNODES/PET_RDZV_* itself; Kubeflow Trainer sets only
    PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and node 0's address (for torchrun's static
    rendezvous, which cannot re-form a group after a restart), so its c10d flags are here."""
    shutdown_timeout = max(grace - profile.shutdown_margin_s, 10)
    timeouts = f"join_timeout={profile.rendezvous_join_timeout_s},read_timeout={profile.rendezvous_join_timeout_s}"
    restarts = [f"--max_restarts={profile.max_restarts}", f"--shutdown_timeout={shutdown_timeout}",
                f"--peer_timeout_s={profile.peer_timeout_s if spec.peer_timeout_s is None else spec.peer_timeout_s}"]
    train = ["-m", "torchrec_cloud", "train", *trainer_args]
    rendezvous = ["--rdzv_backend=c10d", f"--rdzv_id={spec.name}", f"--rdzv_conf={timeouts}"]
    return {
        "shutdown_timeout_s": shutdown_timeout,
        "job": [
            f"--nnodes={spec.nodes}",
            f"--nproc_per_node={spec.procs}",
            *rendezvous,
            f"--rdzv_endpoint={spec.name}-0.{spec.name}:{profile.rendezvous_port}",
            *restarts,
            *train,
        ],
        "pytorchjob": [*restarts, *train],
        "trainjob": [*rendezvous, "--rdzv_endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", *restarts, *train],
    }


def _monitoring(spec: DeploySpec, profile: Profile, port: int):
    """What the profile's metrics collector needs for this job (pod metadata, ports, trainer
    flags, objects to apply), from the one copy of that data (deploy/monitoring.py)."""
    from torchrec_cloud.deploy.monitoring import monitoring_profile

    settings = profile.monitoring
    try:
        return monitoring_profile(
            settings["profile"],
            job_name=spec.name,
            namespace=spec.namespace,
            port=port,
            nproc_per_node=spec.procs,
            scrape_interval=str(settings["scrape_interval"]),
            cluster_wide=spec.cluster_monitoring,
        )
    except ConfigError:
        raise  # a port range past 65535: the user's flag, named
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(
            f"profile {profile.name!r}: monitoring must be {{profile: NAME, scrape_interval: 30s}} "
            f"with NAME an entry of monitoring_profiles.yaml.j2; got {settings!r} ({e})"
        ) from e


def render_documents(spec: DeploySpec, profile: Optional[Profile] = None) -> list[str]:
    """The bundle for ``spec.launcher``, one YAML document (text) per template and per object
    the metrics collector needs."""
    from torchrec_cloud.deploy.schedulable import require_schedulable

    ctx = build_context(spec, profile)
    if spec.job == "preprocess":
        docs = [render_template(name, **ctx) for name in PREPROCESS_TEMPLATES]
    elif spec.job == "daily":
        docs = [render_template(name, **ctx) for name in DAILY_TEMPLATES]
    elif spec.job == "serve":
        from torchrec_cloud.deploy.serving import serve_templates

        docs = [render_template(name, **ctx) for name in serve_templates(spec)]
    else:
        docs = [render_template(name, **ctx) for name in LAUNCHER_TEMPLATES[spec.launcher]]
        docs += [render_template("collector.yaml.j2", manifest=m, **ctx) for m in ctx["monitoring"].manifests]
    docs += [render_template(name, **ctx) for name in ctx["profile"].extra_templates]
    docs = [doc.strip("\n") + "\n" for doc in docs]
    # A pod asking for a device nothing advertises where it may land stays Pending for good.
    require_schedulable(load_documents("---\n".join(docs)), ctx["profile"], spec.spot)
    return docs


def render_bundle(spec: DeploySpec, profile: Optional[Profile] = None) -> str:
    """Multi-document YAML for ``kubectl apply -f -``; raises ``AdmissionError`` (one line
    naming the flag) for a bundle a cluster would refuse."""
    from torchrec_cloud.deploy.admission import check_or_raise

    text = "---\n".join(render_documents(spec, profile))
    check_or_raise(load_documents(text))
    return text


def render_storage(spec: DeploySpec, profile: Optional[Profile] = None) -> Optional[str]:
    """PersistentVolume + claim for the profile's shared file system (None if it has none)."""
    ctx = build_context(spec, profile)
    if not ctx["storage"]:
        return None
    return render_template(ctx["storage"]["template"], **ctx)


def load_documents(text: str) -> list[dict[str, Any]]:
    """Parse multi-document YAML, dropping empty documents."""
    return [d for d in yaml.safe_load_all(text) if d]
