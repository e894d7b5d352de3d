#!/usr/bin/env bash
# The GPU paths end to end on one machine with a CUDA GPU (issue #33): torchrun through the
# real c10d rendezvous with NCCL, train + evaluate + SIGTERM + resume with `fused` tables and
# with `fused_uvm_caching` + --prefetch_pipeline in bf16, UVM cache rows unlocked after an
# evaluation, no device-to-host copy for our batches' feature lengths, checkpoints across
# device counts, pinned batches. From the repository root, with the CUDA stack installed
# (scripts/install.sh on a GPU machine):
#
#   bash bench/gpu_check.sh                 # every check, one line each (PASS / FAIL / NOT RUN)
#   bash bench/gpu_check.sh fused pinned    # some of them
#
# Exit code: 0 every check ran and passed; 1 a check failed; 3 none failed but some could not
# run here (no GPU: each says so). The checks are in bench/gpu_check.py; PYTHON and
# GPU_STAGING: bench/gpu_env.sh.
set -u
cd "$(dirname "$0")/.." || exit 2
. bench/gpu_env.sh
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  for name in "${@:-every check}"; do echo "NOT RUN $name: no $PYTHON (run bash scripts/install.sh, or set PYTHON)"; done
  exit 3
fi
if [ -z "$(gpu_why_not)" ]; then
  prepare_staging || exit 1
fi
exec "$PYTHON" bench/gpu_check.py "$@"
