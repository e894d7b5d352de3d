"""Vertex AI custom jobs for the trainer (google-cloud-aiplatform, optional extra).

A Vertex AI CustomJob has worker pools: pool 0 holds one replica (node 0), pool 1 the other
``nodes - 1``. Each replica runs ``torchrec-cloud launch`` (torchrun, c10d rendezvous at node 0);
its node rank and node 0's address come from the
``CLUSTER_SPEC`` variable Vertex AI sets in every replica, turned into shell variables by
``python -m torchrec_cloud.deploy.vertex rendezvous-env``::

    job = build_custom_job(DeploySpec(cloud="gcp", nodes=2, gpus_per_node=8, image=IMG))
    print(type(job).to_json(job))                       # what would be submitted
    submit_job(job, project="my-project", location="us-central1")

The job is an ``aiplatform_v1`` ``CustomJob`` message, built offline, and refused here for
what Vertex AI would refuse: an accelerator count other than the one an A2/A3 machine type
comes with (the profile's ``fixed_gpus``), an output bucket that is not ``gs://``. The
trainer writes its runs to ``/gcs/BUCKET/runs/NAME`` (Cloud Storage FUSE), and the job's
``baseOutputDirectory`` is that same folder. ``--identity`` is the job's service account
(its credentials reach the checkpoint bucket); a spot job (``Scheduling.Strategy.SPOT``)
restarts as a whole when a worker does (``restart_job_on_worker_restart``: every node meets
again and resumes from the last checkpoint) and checkpoints on a clock (deploy/managed.py).
``pip install -e '.[gcp]'`` brings google-cloud-aiplatform.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from typing import Any, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.managed import check_checkpoint_url, managed_service, with_spot_cadence
from torchrec_cloud.deploy.manifests import build_context
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.spec import DeploySpec, MissingExtraError

# Where Vertex AI mounts Cloud Storage buckets in every replica (Cloud Storage FUSE).
FUSE_ROOT = "/gcs/"


def _types():
    try:
        from google.cloud.aiplatform_v1 import types
    except ImportError as e:
        raise MissingExtraError("google-cloud-aiplatform", "gcp") from e
    return types


def rendezvous_env(cluster_spec: str) -> dict[str, str]:
    """NODE_RANK, MASTER_ADDR, MASTER_PORT of this replica from Vertex AI's CLUSTER_SPEC."""
    try:
        spec = json.loads(cluster_spec)
        pools = spec["cluster"]
        task = spec["task"]
        chief_host, chief_port = pools["workerpool0"][0].rsplit(":", 1)
        pool_index = int(task["type"].removeprefix("workerpool"))
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"CLUSTER_SPEC is not Vertex AI's cluster description: {cluster_spec[:200]!r}") from e
    # Replicas are numbered pool by pool: pool 0 is node 0, pool 1 holds nodes 1..N-1.
    offset = sum(len(pools.get(f"workerpool{i}", [])) for i in range(pool_index))
    return {"NODE_RANK": str(offset + int(task["index"])), "MASTER_ADDR": chief_host, "MASTER_PORT": chief_port}


def container_command(spec: DeploySpec, ctx: dict[str, Any], args: list[str]) -> list[str]:
    """What each replica runs, training with ``args``."""
    launch = [
        "torchrec-cloud",
        "launch",
        f"--nnodes={spec.nodes}",
        f"--nproc_per_node={spec.procs}",
        "--rdzv_backend=c10d",
        f"--rdzv_id={spec.name}",
        f"--rdzv_conf=join_timeout={ctx['join_timeout_s']},read_timeout={ctx['join_timeout_s']}",
        f"--max_restarts={ctx['max_restarts']}",
        f"--shutdown_timeout={ctx['shutdown_timeout_s']}",
        "-m",
        "torchrec_cloud",
        "train",
        *args,
    ]
    # NODE_RANK (exported) tells the launcher whether this replica hosts the store.
    script = (
        'eval "$(python -m torchrec_cloud.deploy.vertex rendezvous-env)" && exec '
        + " ".join(shlex.quote(a) for a in launch[:5])
        + ' --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" '
        + " ".join(shlex.quote(a) for a in launch[5:])
    )
    return ["/bin/bash", "-c", script]


def _output_directory(args: list[str]) -> Optional[str]:
    """The gs:// folder the trainer's --output_dir is, when it is on Cloud Storage FUSE."""
    values = [b for a, b in zip(args, args[1:]) if a == "--output_dir"]
    values += [a.split("=", 1)[1] for a in args if a.startswith("--output_dir=")]
    last = values[-1] if values else ""
    return "gs://" + last[len(FUSE_ROOT):] if last.startswith(FUSE_ROOT) else None


def build_custom_job(spec: DeploySpec, staging_bucket: Optional[str] = None) -> Any:
    """An ``aiplatform_v1.types.CustomJob`` with the two worker pools."""
    types = _types()
    service = managed_service(load_profile(spec.cloud))
    check_checkpoint_url(spec, service)
    if staging_bucket is not None and not staging_bucket.startswith("gs://"):
        raise ConfigError("staging_bucket", f"must be a gs://BUCKET URL (Vertex AI's GcsDestination), got {staging_bucket!r}")
    spec = dataclasses.replace(spec, storage=False)  # Vertex AI reads gs:// through /gcs, not the GKE volume
    ctx = build_context(spec)
    instance = ctx["instance"]
    if instance is None or not instance.vertex_accelerator:
        raise ConfigError("instance_type", "Vertex AI needs an instance with a vertex_accelerator in the profile")
    if instance.fixed_gpus and spec.gpus_per_node != instance.gpus:
        raise ConfigError(
            "gpus_per_node",
            f"{instance.name} comes with exactly {instance.gpus} GPUs (an A2/A3 machine type's count is fixed) and "
            f"Vertex AI refuses acceleratorCount {spec.gpus_per_node}: pass --gpus_per_node {instance.gpus}, or an "
            f"--instance_type with {spec.gpus_per_node} GPUs",
        )
    bucket = staging_bucket.removeprefix("gs://").rstrip("/") if staging_bucket else None
    output_root = f"{FUSE_ROOT}{bucket}/runs" if bucket else "/workspace/runs"
    args = with_spot_cadence(spec, service, spec.trainer_args(output_root, ctx["planned_args"]))
    machine = types.MachineSpec(
        machine_type=instance.name,
        accelerator_type=instance.vertex_accelerator,
        accelerator_count=spec.gpus_per_node,
    )
    container = types.ContainerSpec(
        image_uri=spec.image,
        command=container_command(spec, ctx, args),
        env=[types.EnvVar(name=e["name"], value=e["value"]) for e in ctx["env"]],
    )
    pools = [types.WorkerPoolSpec(machine_spec=machine, replica_count=1, container_spec=container)]
    if spec.nodes > 1:
        pools.append(types.WorkerPoolSpec(machine_spec=machine, replica_count=spec.nodes - 1, container_spec=container))
    job_spec = types.CustomJobSpec(worker_pool_specs=pools)
    output = _output_directory(args)
    if output:
        job_spec.base_output_directory = types.GcsDestination(output_uri_prefix=output)
    if spec.identity:
        job_spec.service_account = spec.identity
    if spec.spot:
        job_spec.scheduling = types.Scheduling(strategy=types.Scheduling.Strategy.SPOT,
                                               restart_job_on_worker_restart=True)
    return types.CustomJob(display_name=spec.name, job_spec=job_spec)


def dump_job(job: Any) -> str:
    return type(job).to_json(job, use_integers_for_enums=False)


def submit_job(job: Any, project: str, location: str) -> Any:
    try:
        from google.cloud import aiplatform_v1
    except ImportError as e:
        raise MissingExtraError("google-cloud-aiplatform", "gcp") from e
    client = aiplatform_v1.JobServiceClient(client_options={"api_endpoint": f"{location}-aiplatform.googleapis.com"})
    return client.create_custom_job(parent=f"projects/{project}/locations/{location}", custom_job=job)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m torchrec_cloud.deploy.vertex rendezvous-env``: shell ``export`` lines."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["rendezvous-env"]:
        print("usage: python -m torchrec_cloud.deploy.vertex rendezvous-env", file=sys.stderr)
        return 2
    if "CLUSTER_SPEC" not in os.environ:  # one replica: nothing to meet
        env = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    else:
        env = rendezvous_env(os.environ["CLUSTER_SPEC"])
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
