"""What the managed training targets (Azure ML, Vertex AI) share: the profile's
``managed_training`` data, where checkpoints may go, and the cadence of a spot job.

A spot VM of either service gets about 30 s of notice before it goes, too little to rely on
the checkpoint the trainer saves on SIGTERM for a large model, and a checkpoint written on
the node's own disk goes with the node. So a job there must checkpoint to a destination
that outlives the node (the profile's ``checkpoint_schemes``: one the service mounts, or a
bucket the trainer writes with the job's identity, ``trainer_written``), and a spot job also on a
clock, in the background (``--checkpoint_every_s`` from the profile's
``spot.checkpoint_every_s``, ``--async_checkpoint``, as its Kubernetes jobs), its trainer
told the grace (``TORCHREC_CLOUD_GRACE_S``, ``reclaim_grace_s``)::

    service = managed_service(profile)                    # ConfigError where the cloud has none
    check_checkpoint_url(spec, service)                   # ConfigError naming the cloud's schemes
    env = checkpoint_environment(spec, service)           # {AZURE_CLIENT_ID: ..., ...} for az:// on Azure ML
    args = trainer_args(spec, ctx, output_root)           # + --checkpoint_every_s 600 --async_checkpoint
    env = environment(spec, service, ctx)                 # + TORCHREC_CLOUD_GRACE_S=30 for --spot
"""

from __future__ import annotations

import os
import re
from typing import Any

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.manifests import GRACE_ENV
from torchrec_cloud.deploy.profiles import Profile
from torchrec_cloud.deploy.spec import DeploySpec


def managed_service(profile: Profile) -> dict[str, Any]:
    """The profile's managed training service, or a ConfigError naming ``--cloud``."""
    if not profile.managed_training:
        raise ConfigError("cloud", f"profile {profile.name!r} has no managed training service (managed_training)")
    return profile.managed_training


def check_checkpoint_url(spec: DeploySpec, service: dict[str, Any]) -> None:
    """Refuse a checkpoint destination the service's jobs cannot keep (one on the node's own
    disk is lost with the node; another cloud's bucket has no credentials there), naming the
    destinations they can; and one the trainer writes itself without what it needs to
    (:func:`checkpoint_environment`)."""
    url = spec.checkpoint_url
    schemes = tuple(service["checkpoint_schemes"])
    if url is not None and not url.startswith(schemes):
        raise ConfigError(
            "checkpoint_url",
            f"{url} is not a destination {service['service']} jobs keep checkpoints in: pass one in "
            f"{' or '.join(schemes)}, e.g. {service['checkpoint_example']}",
        )
    checkpoint_environment(spec, service)


def trainer_writes(spec: DeploySpec, service: dict[str, Any]) -> bool:
    """Whether the trainer writes ``--checkpoint_url`` itself, with the job's identity, rather
    than the service mounting it (the profile's ``managed_training.trainer_written``)."""
    written = service.get("trainer_written") or {}
    return bool(spec.checkpoint_url) and spec.checkpoint_url.startswith(tuple(written.get("schemes", ())))


def checkpoint_environment(spec: DeploySpec, service: dict[str, Any]) -> dict[str, str]:
    """The job's variables that let the trainer write ``--checkpoint_url`` itself: the job's
    identity (``--identity``, which must hold the profile's ``needs``) and where the URL is
    (``location_env``, taken from the environment ``submit`` runs in, as the storage layer
    reads it there); nothing for a destination the service mounts. A ConfigError says which
    is missing."""
    if not trainer_writes(spec, service):
        return {}
    written = service["trainer_written"]
    url = spec.checkpoint_url
    if not spec.identity:
        raise ConfigError(
            "identity",
            f"the trainer writes {url} itself on {service['service']}, with the job's identity: pass --identity "
            f"CLIENT_ID of a user-assigned managed identity (it needs {written['needs']}); or checkpoint to "
            f"{service['checkpoint_example']}",
        )
    env = {written["identity_env"]: spec.identity}
    for name, pattern in written["location_env"].items():
        value = os.environ.get(name, "")
        if not re.fullmatch(pattern, value):
            got = f"it holds {value[:40]!r}" if value else "it is not set"
            raise ConfigError(
                "checkpoint_url",
                f"{url} does not say where it is: the trainer finds it through {name} ({pattern}), "
                f"which `submit` passes to the job from its own environment, and {got}",
            )
        env[name] = value
    return env


def trainer_args(spec: DeploySpec, ctx: dict[str, Any], output_root: str) -> list[str]:
    """The trainer's flags on the service: the spec's and the plan's, and for a spot job what
    every target gives one (a clock cadence, background saves: ``manifests.spot_train_args``),
    unless the training flags set their own."""
    return spec.trainer_args(output_root, [*ctx["spot_args"], *ctx["planned_args"]])


def environment(spec: DeploySpec, service: dict[str, Any], ctx: dict[str, Any]) -> dict[str, str]:
    """The nodes' environment on the service. A spot job's trainer is told the grace its VMs
    get (``reclaim_grace_s``, as on Kubernetes: it saves on SIGTERM only when a save fits);
    otherwise no grace is known there (no terminationGracePeriodSeconds applies), and none is
    told."""
    env = {e["name"]: e["value"] for e in ctx["env"] if e["name"] != GRACE_ENV}
    if spec.spot:
        env[GRACE_ENV] = str(service["reclaim_grace_s"])
    return env
