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
# run here (no GPU: each says so). The checks are in bench/gpu_check.py.
set -u
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-.venv/bin/python}" bench/gpu_check.py "$@"
