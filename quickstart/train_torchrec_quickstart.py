"""The quickstart, as the seed guides run it: DLRM on synthetic data, 1 to N processes.

    python train_torchrec_quickstart.py
    python train_torchrec_quickstart.py --batch_size 4096 --embedding_dim 256 --num_epochs 10 --learning_rate 0.5
    torchrun --standalone --nproc_per_node=4 train_torchrec_quickstart.py

Same as ``torchrec-cloud train --preset quickstart [flags]``; every train flag works here.
"""

import os
import sys

try:
    from torchrec_cloud.cli import main
except ImportError:  # run from a source checkout without `make install`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from torchrec_cloud.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "--preset", "quickstart", *sys.argv[1:]]))
