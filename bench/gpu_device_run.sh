#!/usr/bin/env bash
# One short run on a lent GPU machine that has python3 with a CUDA torch but no network and no
# fbgemm-gpu/torchrec (issue #43): the staging GPU_STAGING (default .gpu: bench/gpu_ship.py's
# slimmed fbgemm-gpu and the torchrec wheels, carried beside the checkout) unpacked into
# /tmp/site, then, each step under its own time limit within BUDGET seconds in all:
# the versions and compat's verdict, one quickstart bf16 figure, bench/gpu_check.sh (the cheap
# in-process checks first), and gpu_bench.sh's uvm phase at bf16, batch 65,536 (the full 40M-row
# tables with the planner held to UVM_GPU_MEMORY GiB, the cache's hit rate; the same tables all
# in GPU memory; the planner's estimates). From the repository root:
#
#   OUT=/tmp/out bash bench/gpu_device_run.sh
#
# $OUT gets four files: summary.txt (every verdict and figure, one line each), steps.log (each
# step's output), bench.log and results.txt (gpu_bench.sh's). Without a GPU: NOT RUN, exit 3.
# Limits (seconds): BUDGET (450, all steps), CHECK_LIMIT (130, the GPU checks), UVM_LIMIT (240);
# the uvm phase's UVM_WARMUP (150), UVM_STEPS (20), UVM_PREFETCH (0; 1 adds --prefetch_pipeline).
set -u
cd "$(dirname "$0")/.." || exit 2
export GPU_STAGING=${GPU_STAGING:-.gpu} PYTHON=${PYTHON:-python3}
# The staged stack (torch 2.11, fbgemm-gpu 1.6, torchrec 1.6) is not the audited one: run the
# names whose source changed as they are (compat.UNAUDITED_ENV), and say so in the log.
export TORCHREC_CLOUD_UNAUDITED_STACK=${TORCHREC_CLOUD_UNAUDITED_STACK:-1}
. bench/gpu_env.sh
OUT=${OUT:-/tmp/gpu_device_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-450}
T0=$SECONDS
SUMMARY=$OUT/summary.txt LOG=$OUT/steps.log

say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME CAP COMMAND...: the command's output to steps.log, under min(CAP, time left) seconds.
# Every process it starts carries GPU_DEVICE_RUN_STEP in its environment (whatever session or
# process group it moves to, as torchrun's workers may); those still alive after it are ended,
# by pid, so that a step cut short leaves no process holding the GPU for the next one.
step() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0)))
  [ "$cap" -lt "$left" ] || cap=$left
  if [ "$cap" -lt 20 ]; then
    say "SKIPPED $name: $left s of the budget left"
    return 1
  fi
  local t0=$SECONDS tag="GPU_DEVICE_RUN_STEP=$$-$name"
  echo "===== $name ($(date +%T), limit $cap s): $*" >>"$LOG"
  env "$tag" timeout -k 5 "$cap" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "step $name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (time limit)')"
  local environ pid
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    if tr '\0' '\n' 2>/dev/null <"$environ" | grep -qxF "$tag"; then
      echo "ending $name's leftover process $pid: $(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-200)" >>"$LOG"
      kill -9 "$pid" 2>/dev/null
    fi
  done
  return $rc
}

why=$(gpu_why_not)
if [ -n "$why" ]; then
  say "NOT RUN gpu_device_run: $why"
  exit 3
fi
say "gpu_device_run: $(date -u +%FT%TZ), budget $BUDGET s, staging $GPU_STAGING, $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
step setup 90 bash -c '. bench/gpu_env.sh && prepare_staging' || { say "setup failed: see steps.log"; exit 1; }
step versions 60 "$PYTHON" -c "
import torch, fbgemm_gpu, torchrec
from torchrec_cloud import compat
print('VERSIONS torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(),
      'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', getattr(torchrec, '__version__', '1.6.1 (staged)'))
print('COMPAT', compat.problems() or 'no problem')
print('COMPAT start-up check passed; speed-ups that fall back:', compat.check() or 'none')"
grep -E '^(VERSIONS|COMPAT)' "$LOG" | tee -a "$SUMMARY"

export OUT  # gpu_bench.sh writes bench.log and results.txt there
step quickstart 75 bash -c '
  . bench/gpu_env.sh
  "$PYTHON" -m torchrec_cloud bench --worker ours --steps 50 --warmup 10 --precision bf16 -- --preset quickstart \
    --batch_size 65536 --synthetic random --no-progress --no-tensorboard | grep "^BENCH " | sed "s/^BENCH /quickstart bf16 b65536 /" \
    | tee -a "$OUT/results.txt"'
grep '^quickstart bf16' "$OUT/results.txt" 2>/dev/null | tee -a "$SUMMARY"

step gpu_check "${CHECK_LIMIT:-130}" bash bench/gpu_check.sh cache_unlocked host_lengths pinned uvm_prefetch fused rng_devices
grep -E '^(PASS|FAIL|NOT RUN) ' "$LOG" | tee -a "$SUMMARY"

step uvm "${UVM_LIMIT:-240}" env UVM_BATCHES=65536 UVM_PRECISIONS=bf16 UVM_PREFETCH="${UVM_PREFETCH:-0}" \
  UVM_WARMUP="${UVM_WARMUP:-150}" UVM_STEPS="${UVM_STEPS:-20}" RUN_TIMEOUT=150 bash bench/gpu_bench.sh uvm
grep -E '^(uvm:|plan |criteo-1tb)' "$OUT/results.txt" 2>/dev/null | tee -a "$SUMMARY"
say "gpu_device_run: done in $((SECONDS - T0)) s"
