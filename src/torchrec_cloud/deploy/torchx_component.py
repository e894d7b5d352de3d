"""TorchX AppDefs for the legacy ``<cloud>/cloud_component.py`` components, and what TorchX's
schedulers cannot carry of them.

TorchX is no longer maintained; the components exist because the guides list them. The
AppDef mirrors TorchX's own ``dist.ddp``: one role of ``nodes`` replicas running
``torchrec-cloud launch`` with the c10d rendezvous at replica 0, plus the profile's
environment, instance type and devices::

    app = build_app(DeploySpec(cloud="generic", nodes=2, gpus_per_node=8))
    python aws/cloud_component.py --dry-run --nodes 2     # the Volcano Job it would submit
    torchx run --dryrun --workspace "" -s kubernetes -cfg queue=default aws/cloud_component.py:trainer

What the pinned torchx (0.7.0) does with it, read from its source:

- ``specs/file_linter.py`` accepts a component only with a return annotation naming
  ``AppDef`` and parameters typed with plain ``int``/``str``/``float``/``bool``,
  ``Optional[...]`` or ``List[...]``; ``specs/builders.py`` reads those types at run time,
  so a component file must not use ``from __future__ import annotations`` (the types
  would be strings and every flag a ``str``).
- ``schedulers/kubernetes_scheduler.py`` (``role_to_pod``) keeps only the
  ``node.kubernetes.io/instance-type`` capability as a node selector and sets no
  tolerations and no ``terminationGracePeriodSeconds`` (30 s, where the launcher stops its
  workers ``shutdown_margin_s`` before the profile's grace). The service account is its
  ``service_account`` run option. So the role carries those pod fields in its
  ``metadata`` under :data:`POD_FIELDS`, and :func:`main` (``python <cloud>/cloud_component.py``)
  writes them into the Volcano Job that torchx's own dryrun produced before it submits it
  through torchx's runner. ``torchx run`` itself submits without them: its pods land only
  on nodes whose taints the API server's ExtendedResourceToleration covers, and never on
  spot nodes.
- ``schedulers/aws_batch_scheduler.py`` expands ``${replica_id}`` to
  ``$AWS_BATCH_JOB_NODE_INDEX`` only where a shell reads it (the role's arguments, not its
  environment), so the node rank is exported by the role's bash script; a ``VolumeMount``
  becomes an EFS file system id, so a Kubernetes claim cannot be its volume (``--mounts``).

torchx is an optional extra (``pip install -e '.[torchx]'``, which brings the kubernetes client
its kubernetes scheduler imports), imported here only.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from typing import Any, Callable, Optional

from torchrec_cloud.config import ConfigError, FlagParser
from torchrec_cloud.deploy.manifests import GRACE_ENV, SERVICE_ACCOUNT, build_context
from torchrec_cloud.deploy.spec import DeploySpec, MissingExtraError

# Role metadata key: the pod fields torchx's kubernetes scheduler has no place for.
POD_FIELDS = "torchrec-cloud/pod"


def _torchx_specs():
    try:
        from torchx import specs
    except ImportError as e:
        raise MissingExtraError("torchx", "torchx") from e
    return specs


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _mem_mb(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", quantity)
    if not m:
        raise ConfigError("instance_type", f"memory request {quantity!r} is not like 800Gi")
    return int(m.group(1)) * _UNITS[m.group(2)] // 2**20


# The grace the trainer is told (TORCHREC_CLOUD_GRACE_S) is the shortest its pods may get:
# ``torchx run`` submits without the terminationGracePeriodSeconds :func:`carry_pod_fields`
# writes back (torchx 0.7 kubernetes_scheduler.py ``role_to_pod`` sets none: Kubernetes'
# default applies).
KUBERNETES_DEFAULT_GRACE_S = 30


def build_app(spec: DeploySpec, mounts: Optional[list[str]] = None) -> Any:
    """A ``torchx.specs.AppDef`` for the spec, filled from its cloud profile. ``mounts`` are
    torchx's mount options (``type=bind,src=/fsx,dst=/fsx``, see ``specs.parse_mounts``);
    None mounts the profile's shared volume as its PersistentVolumeClaim (Kubernetes)."""
    specs = _torchx_specs()
    parsed = None
    if mounts is not None:
        try:
            parsed = specs.parse_mounts(list(mounts))
        except (KeyError, ValueError) as e:
            raise ConfigError("mounts", f"{','.join(mounts)!r}: {e}") from e
        # The runs folder stays on the shared volume only where a mount puts it there.
        from torchrec_cloud.deploy.profiles import load_profile

        storage = load_profile(spec.cloud).storage or {}
        spec = dataclasses.replace(spec, storage=any(m.dst_path == storage.get("mount_path") for m in parsed))
    ctx = build_context(spec)
    requests = ctx["resources"].get("requests", {})
    limits = dict(ctx["resources"].get("limits", {}))
    limits.pop(ctx["profile"].gpu_resource, None)
    limits.pop("memory", None)  # the request's, in memMB below
    limits.pop("cpu", None)  # the request's, in whole cores below
    cpu = str(requests.get("cpu", "1"))
    pod = ctx["pod_spec"]
    resource = specs.Resource(
        cpu=max(1, int(cpu[:-1]) // 1000) if cpu.endswith("m") else int(cpu),
        gpu=spec.gpus_per_node,
        memMB=_mem_mb(requests["memory"]) if "memory" in requests else 4096,
        capabilities=dict(pod.get("nodeSelector", {})),
        devices={k: int(v) for k, v in limits.items()},
    )
    port = ctx["rendezvous_port"]
    torchrun = [
        "torchrec-cloud launch",  # torchrun with exit codes that tell a preemption from a crash
        f"--nnodes={spec.nodes}",
        f"--nproc_per_node={spec.procs}",
        "--rdzv_backend=c10d",
        f"--rdzv_id={specs.macros.app_id}",
        f"--max_restarts={ctx['max_restarts']}",
        f"--shutdown_timeout={ctx['shutdown_timeout_s']}",
        "-m",
        "torchrec_cloud",
        "train",
        *ctx["trainer_args"],
    ]
    # Unquoted so that bash expands them in the container ($$ is TorchX's escape for $):
    # node 0's address, and this node's rank (replica 0 hosts the c10d store), which the
    # aws_batch scheduler turns into $AWS_BATCH_JOB_NODE_INDEX.
    endpoint = f"--rdzv_endpoint=$${{{specs.macros.rank0_env}:=localhost}}:{port}"
    script = (
        f"export TORCHREC_CLOUD_NODE_RANK={specs.macros.replica_id} && exec "
        + torchrun[0] + " " + " ".join(shlex.quote(a) for a in torchrun[1:4]) + f" {endpoint} "
        + " ".join(shlex.quote(a) for a in torchrun[4:])
    )
    if parsed is None:
        parsed = []
        if ctx["storage"]:
            parsed.append(specs.VolumeMount(src=ctx["storage"]["claim_name"], dst_path=ctx["storage"]["mount_path"]))
    carried = {"nodeSelector": pod.get("nodeSelector", {}), "tolerations": pod.get("tolerations", []),
               "terminationGracePeriodSeconds": pod["terminationGracePeriodSeconds"],
               "labels": {**(ctx["profile"].identity or {}).get("pod_labels", {}), **ctx["profile"].pod_labels}}
    role = specs.Role(
        name="trainer",
        image=spec.image,
        entrypoint="bash",
        args=["-c", script],
        num_replicas=spec.nodes,
        resource=resource,
        env={**{e["name"]: e["value"] for e in ctx["env"]},
             GRACE_ENV: str(min(int(ctx["env_grace_s"]), KUBERNETES_DEFAULT_GRACE_S))},
        port_map={"c10d": port},
        max_retries=ctx["backoff_limit"],
        mounts=parsed,
        metadata={POD_FIELDS: carried},
    )
    return specs.AppDef(name=spec.name, roles=[role])


def carry_pod_fields(resource: dict[str, Any], app: Any) -> dict[str, Any]:
    """Write each role's :data:`POD_FIELDS` into the pods of torchx's Volcano Job
    (``KubernetesJob.resource``, from the kubernetes scheduler's dryrun); returns it."""
    from torchx.schedulers.kubernetes_scheduler import sanitize_for_serialization
    from torchx.util.strings import normalize_str

    fields = {normalize_str(role.name): role.metadata.get(POD_FIELDS) or {} for role in app.roles}
    for task in resource["spec"]["tasks"]:
        carried = fields[task["name"].rsplit("-", 1)[0]]
        pod = sanitize_for_serialization(task["template"])
        spec = pod["spec"]
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **carried.get("nodeSelector", {})}
        if carried.get("tolerations"):
            spec["tolerations"] = [*(spec.get("tolerations") or []), *carried["tolerations"]]
        if "terminationGracePeriodSeconds" in carried:
            spec["terminationGracePeriodSeconds"] = carried["terminationGracePeriodSeconds"]
        pod["metadata"]["labels"] = {**(pod["metadata"].get("labels") or {}), **carried.get("labels", {})}
        task["template"] = pod
    return resource


# Run options of our own command per torchx scheduler (its -cfg), under the user's --cfg.
_DEFAULT_CFG = {"kubernetes": {"namespace": "torchrec", "queue": "default", "service_account": SERVICE_ACCOUNT},
                "aws_batch": {}}


def _refuse_claims_on_batch(app: Any) -> None:
    specs = _torchx_specs()
    for mount in app.roles[0].mounts:
        if isinstance(mount, specs.VolumeMount) and not mount.src.startswith("fs-"):
            raise ConfigError(
                "mounts",
                f"AWS Batch mounts a volume as an EFS file system id (torchx's aws_batch scheduler), and "
                f"{mount.src!r} is a Kubernetes claim: pass --mounts type=bind,src=PATH,dst={mount.dst_path} for a "
                f"file system the compute environment mounts on its hosts (FSx), or type=volume,src=fs-ID,dst=PATH "
                f"for EFS",
            )


def main(component: Callable[..., Any], argv: list[str]) -> int:
    """``python <cloud>/cloud_component.py [--dry-run] [--scheduler S] [--cfg K=V,...]
    [component flags] [-- training flags]``: the component through torchx's runner, with the
    pod fields its kubernetes scheduler drops written back, then submitted (``--dry-run``:
    printed)."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = FlagParser(description=(component.__doc__ or "").split("\n")[0],
                        epilog="Component flags are torchx's for this component (torchx run ... --help).")
    parser.add_argument("--dry-run", action="store_true", help="print the scheduler request, submit nothing")
    parser.add_argument("--scheduler", choices=sorted(_DEFAULT_CFG), default="kubernetes",
                        help="torchx scheduler (kubernetes: Volcano)")
    parser.add_argument("--cfg", default="", metavar="K=V,...",
                        help=f"the scheduler's run options, as torchx's -cfg (kubernetes defaults: "
                             f"{','.join(f'{k}={v}' for k, v in _DEFAULT_CFG['kubernetes'].items())})")
    ns, rest = parser.parse_known_args(argv[:split])
    try:
        from torchx.runner import get_runner
        from torchx.specs import InvalidRunConfigException
        from torchx.specs.builders import materialize_appdef
    except ImportError as e:
        raise MissingExtraError("torchx", "torchx") from e
    try:
        app = materialize_appdef(component, [*rest, *argv[split:]])
        if ns.scheduler == "aws_batch":
            _refuse_claims_on_batch(app)
        with get_runner() as runner:
            opts = runner.scheduler_run_opts(ns.scheduler)
            cfg = {**_DEFAULT_CFG[ns.scheduler], **opts.cfg_from_str(ns.cfg)}
            info = runner.dryrun(app, ns.scheduler, cfg=cfg, workspace=None)
            if ns.scheduler == "kubernetes":
                carry_pod_fields(info.request.resource, app)
            if ns.dry_run:
                print(info)
                return 0
            print(runner.schedule(info))
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except InvalidRunConfigException as e:
        print(f"{parser.prog}: error: --cfg: {ns.scheduler} needs the run option {e.cfg_key!r}", file=sys.stderr)
        return 2
    return 0
