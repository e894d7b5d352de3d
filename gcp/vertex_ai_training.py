"""Submit DLRM training as a Vertex AI custom job (worker pools, custom container).

    python gcp/vertex_ai_training.py --dry-run --nodes 2                   # print the job
    python gcp/vertex_ai_training.py --nodes 2 --image us-central1-docker.pkg.dev/PROJECT/torchrec/torchrec-cloud:0.1.0 \\
        --project PROJECT --region us-central1 --staging_bucket gs://BUCKET -- --batch_size 4096

Same as ``torchrec-cloud submit --target vertex --cloud gcp``; every render flag works
(``--spot``, ``--instance_type``, ``--preset``, training flags after ``--``). Needs
``pip install -e '.[gcp]'``. The image defaults to the profile's registry.
"""

import sys

from torchrec_cloud.deploy.layout import cloud_image
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.submit import main


TARGET = "vertex"


def arguments(argv: list[str]) -> list[str]:
    """What ``submit --target vertex`` is given for this script's ``argv``."""
    return ["--cloud", "gcp", *defaults(argv), *argv]


def defaults(argv: list[str]) -> list[str]:
    head = argv[: argv.index("--")] if "--" in argv else argv
    extra = []
    if not any(a.startswith("--image") for a in head):
        extra += ["--image", cloud_image(load_profile("gcp"))]
    if not any(a.startswith("--preset") for a in head):
        extra += ["--preset", "criteo-1tb"]
    return extra


if __name__ == "__main__":
    sys.exit(main(arguments(sys.argv[1:]), TARGET, prog=f"python {sys.argv[0]}", description=__doc__))
