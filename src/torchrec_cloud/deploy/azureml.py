"""Azure Machine Learning command jobs for the trainer (azure-ai-ml SDK, optional extra).

Azure ML starts one process per node here (``PyTorchDistribution(process_count_per_instance=1)``)
and sets ``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK`` on each; that process is
``torchrec-cloud launch`` (torchrun with c10d rendezvous at node 0, which re-forms the group
after a restart, and exit codes that tell a preemption from a crash), which starts one trainer per GPU with the right ``LOCAL_WORLD_SIZE`` (the sharding planner
needs it). Letting Azure ML start the GPU processes itself *and* calling torchrun, as the
original guide did, would start G x G trainers per node::

    job = build_command_job(DeploySpec(cloud="azure", nodes=2, gpus_per_node=8, image=IMG), compute="gpu-cluster")
    print(dump_job(job))                                  # what would be submitted
    submit_job(job, subscription_id=..., resource_group="torchrec-rg", workspace="torchrec-ws")

Spot, as azure-ai-ml 1.35.2 has it: a compute cluster's priority is the cluster's own
(``az ml compute create --tier low_priority``), so a job cannot ask for it; serverless
compute takes a job tier (``command(job_tier="Spot")``, ``QueueSettings``). ``--spot``
therefore runs on serverless compute (the profile's instance type) unless ``--compute``
names a cluster, which must then be a low-priority one. Checkpoints go to a datastore path
(``--checkpoint_url azureml://datastores/NAME/paths/PATH``), mounted read-write on every
node as the job's output ``checkpoints`` (``Output(mode="rw_mount")``) and reached with the
job's identity (``--identity``: a user-assigned managed identity's client id) where the
datastore keeps no credentials. Or to a blob container (``--checkpoint_url az://CONTAINER/PATH``),
which the trainer writes itself with that identity (``--identity`` is then required: it needs
Storage Blob Data Contributor on the account, and to be assigned to the compute cluster), in
the storage account ``AZURE_STORAGE_ACCOUNT_NAME`` names where ``submit`` runs (passed to
the job with ``AZURE_CLIENT_ID``). A spot job also checkpoints on a clock (deploy/managed.py).

``pip install -e '.[azure]'`` brings azure-ai-ml and azure-identity.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any, Optional

import yaml

from torchrec_cloud.deploy.managed import (
    check_checkpoint_url,
    checkpoint_environment,
    environment,
    managed_service,
    trainer_args,
    trainer_writes,
)
from torchrec_cloud.deploy.manifests import build_context
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.spec import DeploySpec, MissingExtraError

# Azure ML uploads ./outputs of each run; rank 0 writes metrics.jsonl there.
OUTPUT_ROOT = "./outputs"
# The compute of a job that names none: a cluster for on-demand jobs (`az ml compute
# create`, azure/README.md), serverless compute for spot ones (the only compute whose tier a
# job sets).
DEFAULT_CLUSTER = "gpu-cluster"
SERVERLESS = "serverless"
# The job output the checkpoint datastore path is mounted as; Azure ML puts its mount path
# in place of this expression in the command.
CHECKPOINT_OUTPUT = "checkpoints"


def _sdk():
    try:
        from azure.ai.ml import Output, PyTorchDistribution, command
        from azure.ai.ml.entities import Environment, ManagedIdentityConfiguration
    except ImportError as e:
        raise MissingExtraError("azure-ai-ml", "azure") from e
    return command, PyTorchDistribution, Environment, Output, ManagedIdentityConfiguration


def _docker_size(quantity: str) -> str:
    """Kubernetes quantity (64Gi) -> Docker size (64g), the form Azure ML's shm_size takes."""
    for k8s, docker in (("Gi", "g"), ("Mi", "m"), ("Ki", "k")):
        if quantity.endswith(k8s):
            return quantity[: -len(k8s)] + docker
    return quantity


def torchrun_command(spec: DeploySpec, ctx: dict[str, Any], args: list[str]) -> str:
    """The shell command each node runs, training with ``args``; rendezvous values come from
    Azure ML's variables (NODE_RANK says which node hosts the store)."""
    parts = [
        "torchrec-cloud",
        "launch",
        f"--nnodes={spec.nodes}",
        f"--nproc_per_node={spec.procs}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT",
        f"--rdzv_id={spec.name}",
        f"--rdzv_conf=join_timeout={ctx['join_timeout_s']},read_timeout={ctx['join_timeout_s']}",
        f"--max_restarts={ctx['max_restarts']}",
        f"--shutdown_timeout={ctx['shutdown_timeout_s']}",
        "-m",
        "torchrec_cloud",
        "train",
    ]
    return " ".join(parts) + " " + " ".join(shlex.quote(a) for a in args)


def build_command_job(spec: DeploySpec, compute: Optional[str] = None, experiment: str = "torchrec-cloud") -> Any:
    """An ``azure.ai.ml`` command job: ``spec.nodes`` instances of ``compute`` (a cluster's
    name, or ``serverless``; default: module docstring) running the image."""
    command, PyTorchDistribution, Environment, Output, ManagedIdentityConfiguration = _sdk()
    service = managed_service(load_profile(spec.cloud))
    check_checkpoint_url(spec, service)
    outputs = {}
    checkpoint_env = checkpoint_environment(spec, service)
    if spec.checkpoint_url and not trainer_writes(spec, service):
        outputs[CHECKPOINT_OUTPUT] = Output(type="uri_folder", path=spec.checkpoint_url, mode="rw_mount")
        spec = dataclasses.replace(spec, checkpoint_url="${{outputs.%s}}" % CHECKPOINT_OUTPUT)
    spec = dataclasses.replace(spec, storage=False)  # Azure ML mounts data through inputs, not the AKS volume
    ctx = build_context(spec)
    args = trainer_args(spec, ctx, OUTPUT_ROOT)
    compute = compute or (SERVERLESS if spec.spot else DEFAULT_CLUSTER)
    placement: dict[str, Any] = {}
    if compute == SERVERLESS:
        # Serverless compute has no machine of its own: the job names the VM size and tier.
        placement["instance_type"] = ctx["instance"].name if ctx["instance"] else None
        if spec.spot:
            placement["job_tier"] = service["spot_job_tier"]
    return command(
        command=torchrun_command(spec, ctx, args),
        environment=Environment(image=spec.image),
        compute=compute,
        instance_count=spec.nodes,
        distribution=PyTorchDistribution(process_count_per_instance=1),
        shm_size=_docker_size(spec.shm_size or ctx["profile"].shm_size),
        environment_variables={**environment(spec, service, ctx), **checkpoint_env},
        outputs=outputs,
        identity=ManagedIdentityConfiguration(client_id=spec.identity) if spec.identity else None,
        display_name=spec.name,
        experiment_name=experiment,
        **placement,
    )


def dump_job(job: Any) -> str:
    """The job as Azure ML's YAML (what ``az ml job create -f`` would take)."""
    # The `command()` builder serializes as a pipeline node (no command line); the job it
    # submits is its CommandJob form.
    plain = json.loads(json.dumps(job._to_job()._to_dict()))  # OrderedDicts -> dicts
    return yaml.safe_dump(plain, sort_keys=False, width=10000)


def submit_job(job: Any, subscription_id: str, resource_group: str, workspace: str) -> Any:
    try:
        from azure.ai.ml import MLClient
        from azure.identity import DefaultAzureCredential
    except ImportError as e:
        raise MissingExtraError("azure-ai-ml / azure-identity", "azure") from e
    client = MLClient(DefaultAzureCredential(), subscription_id, resource_group, workspace)
    return client.jobs.create_or_update(job)
