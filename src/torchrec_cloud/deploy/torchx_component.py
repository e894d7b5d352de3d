"""TorchX AppDefs for the legacy ``<cloud>/cloud_component.py`` components.

TorchX is no longer maintained; the components exist because the guides list them. The
AppDef mirrors TorchX's own ``dist.ddp``: one role of ``nodes`` replicas running torchrun
with the c10d rendezvous at replica 0 (TorchX sets ``TORCHX_RANK0_HOST`` to ``localhost`` on
replica 0, so it hosts the store), plus the profile's environment, node selector and
devices::

    app = build_app(DeploySpec(cloud="generic", nodes=2, gpus_per_node=8))
    python aws/cloud_component.py --dry-run          # prints the AppDef

torchx is an optional extra (``pip install -e '.[torchx]'``), imported here only.
"""

from __future__ import annotations

import inspect
import pprint
import re
import shlex
import sys
from typing import Any, Callable

from torchrec_cloud.config import ConfigError, FlagParser
from torchrec_cloud.deploy.manifests import build_context
from torchrec_cloud.deploy.spec import DeploySpec, MissingExtraError


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


def build_app(spec: DeploySpec) -> Any:
    """A ``torchx.specs.AppDef`` for the spec, filled from its cloud profile."""
    specs = _torchx_specs()
    ctx = build_context(spec)
    requests = ctx["resources"].get("requests", {})
    limits = dict(ctx["resources"].get("limits", {}))
    limits.pop(ctx["profile"].gpu_resource, None)
    resource = specs.Resource(
        cpu=int(requests.get("cpu", 1)),
        gpu=spec.gpus_per_node,
        memMB=_mem_mb(requests["memory"]) if "memory" in requests else 4096,
        capabilities=dict(ctx["pod_spec"].get("nodeSelector", {})),
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
    # Unquoted so that bash expands it in the pod ($$ is TorchX's escape for $).
    endpoint = f"--rdzv_endpoint=$${{{specs.macros.rank0_env}:=localhost}}:{port}"
    script = torchrun[0] + " " + " ".join(shlex.quote(a) for a in torchrun[1:4]) + f" {endpoint} " + " ".join(
        shlex.quote(a) for a in torchrun[4:]
    )
    # TorchX's Kubernetes scheduler adds /dev/shm itself; the shared file system is a PVC.
    mounts = []
    if ctx["storage"]:
        mounts.append(specs.VolumeMount(src=ctx["storage"]["claim_name"], dst_path=ctx["storage"]["mount_path"]))
    role = specs.Role(
        name="trainer",
        image=spec.image,
        entrypoint="bash",
        args=["-c", script],
        num_replicas=spec.nodes,
        resource=resource,
        # Replica 0 hosts the c10d store.
        env={**{e["name"]: e["value"] for e in ctx["env"]}, "TORCHREC_CLOUD_NODE_RANK": specs.macros.replica_id},
        port_map={"c10d": port},
        max_retries=ctx["backoff_limit"],
        mounts=mounts,
    )
    return specs.AppDef(name=spec.name, roles=[role])


def main(component: Callable[..., Any], argv: list[str]) -> int:
    """``python <cloud>/cloud_component.py [--nodes N ...] [--dry-run] [-- training flags]``."""
    params = inspect.signature(component).parameters
    parser = FlagParser(description=(component.__doc__ or "").split("\n")[0])
    for name, p in params.items():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if isinstance(p.default, bool):
            parser.add_argument(f"--{name}", action="store_true", default=p.default)
        else:
            parser.add_argument(f"--{name}", type=type(p.default), default=p.default)
    parser.add_argument("--dry-run", action="store_true", help="print the AppDef, submit nothing")
    parser.add_argument("--namespace", default="torchrec", help="Kubernetes namespace (TorchX scheduler cfg)")
    parser.add_argument("--queue", default="default", help="Volcano queue (TorchX scheduler cfg)")
    parser.add_argument("train_args", nargs="*", help="flags for `torchrec-cloud train` after '--'")
    ns = parser.parse_args(argv)
    kwargs = {n: getattr(ns, n) for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    try:
        app = component(*ns.train_args, **kwargs)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if ns.dry_run:
        print(pprint.pformat(app, width=100))  # one field a line: the AppDef's repr is one line of ~1,000 characters
        return 0
    from torchx.runner import get_runner

    cfg = {"namespace": ns.namespace, "queue": ns.queue}
    with get_runner() as runner:
        handle = runner.run(app, scheduler="kubernetes", cfg=cfg)
    print(handle)
    return 0
