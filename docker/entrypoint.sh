#!/usr/bin/env bash
# Entrypoint of the torchrec-cloud images. Accepts what the quickstart guide types after
# the image name, plus any command:
#
#   docker run IMAGE                                   # python train_torchrec_quickstart.py
#   docker run IMAGE train_torchrec_quickstart.py --batch_size 4096
#   docker run IMAGE -m torch.distributed.run --standalone --nproc_per_node=4 train_torchrec_quickstart.py
#   docker run IMAGE torchrun --standalone --nproc_per_node=4 -m torchrec_cloud train --preset quickstart
#   docker run IMAGE torchrec-cloud train --preset criteo-1tb
#   docker run -it IMAGE bash
#
# A first argument that is a Python option (-m, -c, -u, ...) or a .py file goes to
# `python`; anything else is run as a command. exec keeps the trainer as PID 1's
# successor, so SIGTERM (docker stop, pod deletion) reaches it and it can checkpoint.
set -euo pipefail

if [ "$#" -eq 0 ]; then
  set -- train_torchrec_quickstart.py
fi

case "$1" in
  -*|*.py) exec python "$@" ;;
  *) exec "$@" ;;
esac
