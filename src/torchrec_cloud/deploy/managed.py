"""What the managed training targets (Azure ML, Vertex AI) share: the profile's
``managed_training`` data, where checkpoints may go, and the cadence of a spot job.

A spot VM of either service gets about 30 s of notice before it goes, too little to rely on
the checkpoint the trainer saves on SIGTERM for a large model, and a checkpoint written on
the node's own disk goes with the node. So a job there must checkpoint to a destination
that outlives the node (the profile's ``checkpoint_schemes``), and a spot job also on a
clock, in the background (``--checkpoint_every_s`` from the profile's
``spot.checkpoint_every_s``, ``--async_checkpoint``, as its Kubernetes jobs), its trainer
told the grace (``TORCHREC_CLOUD_GRACE_S``, ``reclaim_grace_s``)::

    service = managed_service(profile)                    # ConfigError where the cloud has none
    check_checkpoint_url(spec, service)                   # ConfigError naming the cloud's schemes
    args = trainer_args(spec, ctx, output_root)           # + --checkpoint_every_s 600 --async_checkpoint
    env = environment(spec, service, ctx)                 # + TORCHREC_CLOUD_GRACE_S=30 for --spot
"""

from __future__ import annotations

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
    """A checkpoint destination on the node's own disk is lost with the node: refuse it,
    naming the destinations the service can keep."""
    url = spec.checkpoint_url
    schemes = tuple(service["checkpoint_schemes"])
    if url is not None and not url.startswith(schemes):
        raise ConfigError(
            "checkpoint_url",
            f"{url} would not outlive the node on {service['service']}: pass a destination in "
            f"{' or '.join(schemes)}, e.g. {service['checkpoint_example']}",
        )


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
