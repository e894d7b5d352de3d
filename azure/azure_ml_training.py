"""Submit DLRM training as an Azure Machine Learning command job (PyTorch distribution).

    python azure/azure_ml_training.py --dry-run --nodes 2                  # print the job
    python azure/azure_ml_training.py --nodes 2 --image REGISTRY.azurecr.io/torchrec-cloud:0.1.0 \\
        --subscription_id SUB --resource_group torchrec-rg --workspace torchrec-workspace --compute gpu-cluster \\
        -- --batch_size 4096

Same as ``torchrec-cloud submit --target azureml --cloud azure``; every render flag works
(``--spot``, ``--instance_type``, ``--preset``, training flags after ``--``). Needs
``pip install -e '.[azure]'``. The image defaults to the profile's registry.
"""

import sys

from torchrec_cloud.deploy.layout import cloud_image
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.submit import main


TARGET = "azureml"


def arguments(argv: list[str]) -> list[str]:
    """What ``submit --target azureml`` is given for this script's ``argv``."""
    return ["--cloud", "azure", *defaults(argv), *argv]


def defaults(argv: list[str]) -> list[str]:
    head = argv[: argv.index("--")] if "--" in argv else argv
    extra = []
    if not any(a.startswith("--image") for a in head):
        extra += ["--image", cloud_image(load_profile("azure"))]
    if not any(a.startswith("--preset") for a in head):
        extra += ["--preset", "criteo-1tb"]
    return extra


if __name__ == "__main__":
    sys.exit(main(arguments(sys.argv[1:]), TARGET, prog=f"python {sys.argv[0]}", description=__doc__))
