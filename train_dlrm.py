"""DLRM training with the seed guides' Criteo flags, where their manifests expect it.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        train_dlrm.py --num_embeddings_per_feature 40000000,39060,... --embedding_dim 128 \\
        --dense_arch_layer_sizes 512,256,128 --over_arch_layer_sizes 1024,1024,512,256,1 \\
        --batch_size 2048 --learning_rate 1.0 --dataset_path /fsx/criteo/

Same as ``torchrec-cloud train --preset criteo-1tb [flags]``; every train flag works here.
"""

import os
import sys

try:
    from torchrec_cloud.cli import main
except ImportError:  # run from a source checkout without `make install`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))
    from torchrec_cloud.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "--preset", "criteo-1tb", *sys.argv[1:]]))
