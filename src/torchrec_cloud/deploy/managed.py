"""What the managed training targets (Azure ML, Vertex AI) share: the profile's
``managed_training`` data, where checkpoints may go, and the cadence of a spot job.

A spot VM of either service gets about 30 s of notice before it goes, too little to rely on
the checkpoint the trainer saves on SIGTERM for a large model, and a checkpoint written on
the node's own disk goes with the node. So a job there must checkpoint to a destination
that outlives the node (the profile's ``checkpoint_schemes``), and a spot job also on a
clock (``--checkpoint_every_s``, ``spot_checkpoint_every_s``)::

    service = managed_service(profile)                    # ConfigError where the cloud has none
    check_checkpoint_url(spec, service)                   # ConfigError naming the cloud's schemes
    args = with_spot_cadence(spec, service, args)         # + --checkpoint_every_s 600 for --spot
"""

from __future__ import annotations

from typing import Any

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy.profiles import Profile
from torchrec_cloud.deploy.spec import DeploySpec

CADENCE_FLAG = "--checkpoint_every_s"


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


def with_spot_cadence(spec: DeploySpec, service: dict[str, Any], args: list[str]) -> list[str]:
    """``args`` with the service's time-based checkpoint cadence for a spot job, unless the
    training flags set one."""
    if not spec.spot or any(a == CADENCE_FLAG or a.startswith(CADENCE_FLAG + "=") for a in args):
        return args
    out = [*args, CADENCE_FLAG, str(service["spot_checkpoint_every_s"])]
    from torchrec_cloud.deploy import spec as spec_module

    if CADENCE_FLAG in spec_module.trainer_flags():
        # The trainer checks the value as it would at start-up.
        from torchrec_cloud.config import config_from_args

        config_from_args(spec_module._trainer_parser().parse_args(out))
    return out
