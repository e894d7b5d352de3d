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

``pip install -e '.[azure]'`` brings azure-ai-ml and azure-identity.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

import yaml

from torchrec_cloud.deploy.manifests import build_context
from torchrec_cloud.deploy.spec import DeploySpec, MissingExtraError

# Azure ML uploads ./outputs of each run; rank 0 writes metrics.jsonl there.
OUTPUT_ROOT = "./outputs"


def _sdk():
    try:
        from azure.ai.ml import PyTorchDistribution, command
        from azure.ai.ml.entities import Environment
    except ImportError as e:
        raise MissingExtraError("azure-ai-ml", "azure") from e
    return command, PyTorchDistribution, Environment


def _docker_size(quantity: str) -> str:
    """Kubernetes quantity (64Gi) -> Docker size (64g), the form Azure ML's shm_size takes."""
    for k8s, docker in (("Gi", "g"), ("Mi", "m"), ("Ki", "k")):
        if quantity.endswith(k8s):
            return quantity[: -len(k8s)] + docker
    return quantity


def torchrun_command(spec: DeploySpec, ctx: dict[str, Any]) -> str:
    """The shell command each node runs; rendezvous values come from Azure ML's variables
    (NODE_RANK says which node hosts the store)."""
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
    args = spec.trainer_args(OUTPUT_ROOT, ctx["planned_args"])
    return " ".join(parts) + " " + " ".join(shlex.quote(a) for a in args)


def build_command_job(spec: DeploySpec, compute: str, experiment: str = "torchrec-cloud") -> Any:
    """An ``azure.ai.ml`` command job: ``spec.nodes`` instances of ``compute`` running the image."""
    command, PyTorchDistribution, Environment = _sdk()
    spec = dataclasses.replace(spec, storage=False)  # Azure ML mounts data through inputs, not the AKS volume
    ctx = build_context(spec)
    return command(
        command=torchrun_command(spec, ctx),
        environment=Environment(image=spec.image),
        compute=compute,
        instance_count=spec.nodes,
        distribution=PyTorchDistribution(process_count_per_instance=1),
        shm_size=_docker_size(spec.shm_size or ctx["profile"].shm_size),
        environment_variables={e["name"]: e["value"] for e in ctx["env"]},
        display_name=spec.name,
        experiment_name=experiment,
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
