#!/usr/bin/env bash
# Measure our trainer on one CUDA GPU, from a checkout where scripts/install.sh ran (issue #7,
# #43). One BENCH figure per line on stdout and in $OUT/results.txt, full logs in $OUT/bench.log:
#
#   bash scripts/install.sh && bash bench/gpu_bench.sh      # phases info quickstart criteo uvm
#   bash bench/gpu_bench.sh info uvm                        # the named phases, in order
#
# Phases: info (versions, nvidia-smi, the GPU gauges' tests), quickstart, criteo (its 40M-row
# tables capped at CAP rows), profile_quickstart, profile_criteo, ab (AB_VARIANTS="base src":
# src_base/ against src/, same machine), uvm (criteo-1tb with its full 40M-row tables: the
# planner held to UVM_GPU_MEMORY GiB so that it caches tables in host memory even on a GPU that
# could hold them all, ids with a power-law skew, the cache warmed before timing and its hit
# rate recorded; the same tables all in GPU memory; the planner's estimates: docs/plan.md).
# Without a CUDA GPU each phase prints `NOT RUN phase: why` and the exit code is 3; 1 when a
# measurement failed, 2 for an unknown phase. PYTHON and GPU_STAGING: bench/gpu_env.sh.
set -u
cd "$(dirname "$0")/.." || exit 2
. bench/gpu_env.sh
PHASES=(info quickstart criteo profile_quickstart profile_criteo ab uvm)
[ $# -gt 0 ] || set -- info quickstart criteo uvm
for phase in "$@"; do
  case " ${PHASES[*]} " in
    *" $phase "*) ;;
    *) echo "gpu_bench: no phase $phase (phases: ${PHASES[*]})" >&2; exit 2 ;;
  esac
done
why=$(gpu_why_not)
if [ -n "$why" ]; then
  for phase in "$@"; do echo "NOT RUN $phase: $why"; done
  exit 3
fi
prepare_staging || exit 1

OUT=${OUT:-/tmp/gpu_bench_out}
mkdir -p "$OUT"
STEPS=${STEPS:-50}
WARMUP=${WARMUP:-10}
# Criteo 1TB tables capped at CAP rows (5 tables of 40M do not fit 80 GB in fp32).
CAP=${CAP:-20000000}
CRITEO_ROWS=$("$PYTHON" -c "
sizes = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
         2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
print(','.join(str(min(s, $CAP)) for s in sizes))")
COMMON=(--synthetic random --no-progress --no-tensorboard)
# uvm: the planner's GPU memory (79 GiB: an 80 GB GPU's; there it caches 3 of the 5 40M-row
# tables), warm-up steps (with the planted power law a 20% cache fills in ~180 steps of 65,536:
# bench/RESULTS.md), timed steps, batches and precisions.
UVM_GPU_MEMORY=${UVM_GPU_MEMORY:-79}
UVM_WARMUP=${UVM_WARMUP:-150}
UVM_STEPS=${UVM_STEPS:-30}
UVM_BATCHES=${UVM_BATCHES:-65536 131072}
UVM_PRECISIONS=${UVM_PRECISIONS:-tf32 bf16}
UVM_PREFETCH=${UVM_PREFETCH:-1}
FAILED=0

# bench NAME [bench flags] -- [train flags]: one worker; its BENCH line to stdout, log to $OUT.
bench() {
  local name=$1; shift
  local t0=$SECONDS
  echo "### $name: $*" >>"$OUT/bench.log"
  timeout -k 10 "${RUN_TIMEOUT:-300}" "$PYTHON" -m torchrec_cloud bench --worker ours --steps "$STEPS" \
    --warmup "$WARMUP" "$@" >"$OUT/run.log" 2>&1
  local rc=$?
  cat "$OUT/run.log" >>"$OUT/bench.log"
  local line
  line=$(grep '^BENCH ' "$OUT/run.log" | tail -1)
  if [ -n "$line" ]; then
    echo "$name ${line#BENCH } wall=$((SECONDS - t0))s" | tee -a "$OUT/results.txt"
  else
    echo "$name FAILED rc=$rc wall=$((SECONDS - t0))s" | tee -a "$OUT/results.txt"
    grep -v '^\s*$' "$OUT/run.log" | tail -15
    rm -f "$OUT/run.log"
    FAILED=1
    return 1
  fi
  rm -f "$OUT/run.log"
}

# plan_line NAME GIB BATCH [train flags]: the planner's choice and estimate for one GPU of GIB.
plan_line() {
  local name=$1 gib=$2 bs=$3; shift 3
  timeout 120 "$PYTHON" -m torchrec_cloud plan --preset criteo-1tb --batch_size "$bs" --gpus_per_node 1 \
    --gpu_memory "$gib" "$@" --json >"$OUT/plan.log" 2>&1
  tail -1 "$OUT/plan.log" | "$PYTHON" -c '
import json, sys
try:
    r = json.load(sys.stdin)
except ValueError:
    sys.exit("plan %s FAILED (see bench.log)" % sys.argv[1])
print("plan %s fits=%s kernels=%s estimated_step_ms=%s" % (sys.argv[1], r["fits"], r["kernels"], r["estimated_step_ms"]))
' "$name b$bs (planner at $gib GiB)" | tee -a "$OUT/results.txt"
  cat "$OUT/plan.log" >>"$OUT/bench.log"
  rm -f "$OUT/plan.log"
}

info() {
  nvidia-smi
  "$PYTHON" -c "
import torch, fbgemm_gpu, torchrec, tensordict
from torchrec_cloud import compat
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())
print('fbgemm_gpu', fbgemm_gpu.__version__, fbgemm_gpu.__file__)
print('torchrec', getattr(torchrec, '__version__', '?'), torchrec.__file__)
print('tensordict', tensordict.__version__)
print('compat problems (entry: what):', compat.problems() or 'none')"
  # GPU-only tests (skipped on CPU machines).
  [ "${INFO_TESTS:-1}" = 1 ] && timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_prometheus.py \
    -k "gpu_gauges or own_gpu or cpu_machine" -rs 2>&1 | tail -5
  return 0
}

quickstart() {
  # A failure of the first run (a missing kernel, say) would repeat in every other: stop.
  for bs in 16384 65536 131072; do
    bench "quickstart fp32 b$bs" --precision fp32 -- --preset quickstart --batch_size $bs "${COMMON[@]}" || return
  done
  for p in tf32 bf16; do
    for bs in 65536 131072; do
      bench "quickstart $p b$bs" --precision $p -- --preset quickstart --batch_size $bs "${COMMON[@]}"
    done
  done
}

criteo() {
  for p in fp32 tf32 bf16; do
    for bs in 65536 131072; do
      bench "criteo-1tb(cap $CAP) $p b$bs" --precision $p -- --preset criteo-1tb --batch_size $bs \
        --num_embeddings_per_feature "$CRITEO_ROWS" "${COMMON[@]}" || return
    done
  done
}

profile_quickstart() {
  STEPS=20 bench "profile quickstart ${PROF_PRECISION:-bf16} b65536" --precision "${PROF_PRECISION:-bf16}" \
    --profile "$OUT/prof_quickstart.txt" -- --preset quickstart --batch_size 65536 "${COMMON[@]}"
  gzip -f "$OUT"/*.trace.json 2>/dev/null
}

profile_criteo() {
  STEPS=20 bench "profile criteo-1tb(cap $CAP) ${PROF_PRECISION:-bf16} b65536" --precision "${PROF_PRECISION:-bf16}" \
    --profile "$OUT/prof_criteo.txt" -- --preset criteo-1tb --batch_size 65536 \
    --num_embeddings_per_feature "$CRITEO_ROWS" "${COMMON[@]}"
  gzip -f "$OUT"/*.trace.json 2>/dev/null
}

uvm() {
  local gib
  gib=$("$PYTHON" -c 'import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))')
  echo "uvm: criteo-1tb, full 40M-row tables; the planner is held to $UVM_GPU_MEMORY GiB of this GPU's $gib GiB" \
       "(bench --gpu_memory $UVM_GPU_MEMORY), so it caches in host memory (UVM) the tables that would not fit;" \
       "ids --synthetic planted (power law); $UVM_WARMUP warm-up steps fill the cache, $UVM_STEPS timed;" \
       "uvm_cache_hit_rate: distinct ids per batch found in the cache, timed steps" | tee -a "$OUT/results.txt"
  local flags=(--preset criteo-1tb --synthetic planted --no-progress --no-tensorboard)
  for bs in $UVM_BATCHES; do
    plan_line "criteo-1tb(full)" "$UVM_GPU_MEMORY" "$bs"
    plan_line "criteo-1tb(full)" "$gib" "$bs"
  done
  for p in $UVM_PRECISIONS; do
    for bs in $UVM_BATCHES; do
      STEPS=$UVM_STEPS WARMUP=$UVM_WARMUP bench "criteo-1tb(full, uvm at $UVM_GPU_MEMORY GiB) $p b$bs" \
        --precision $p --gpu_memory "$UVM_GPU_MEMORY" -- "${flags[@]}" --batch_size $bs
      [ "$UVM_PREFETCH" = 1 ] && STEPS=$UVM_STEPS WARMUP=$UVM_WARMUP \
        bench "criteo-1tb(full, uvm at $UVM_GPU_MEMORY GiB, prefetch) $p b$bs" --precision $p \
        --gpu_memory "$UVM_GPU_MEMORY" -- "${flags[@]}" --batch_size $bs --prefetch_pipeline
      # No cache to warm: the usual warm-up.
      STEPS=$UVM_STEPS bench "criteo-1tb(full, all in GPU memory) $p b$bs" --precision $p \
        -- "${flags[@]}" --batch_size $bs --embedding_kernel fused
    done
  done
}

# A/B of source variants (src_<name>/ beside src/) on the same machine.
ab() {
  local q=(--preset quickstart "${COMMON[@]}")
  local c=(--preset criteo-1tb --num_embeddings_per_feature "$CRITEO_ROWS" "${COMMON[@]}")
  local rest=${PYTHONPATH#"$PWD/src"}
  for p in ${AB_PRECISIONS:-bf16}; do
    for v in ${AB_VARIANTS:-base src}; do
      local src=$PWD/src_$v; [ "$v" = src ] && src=$PWD/src
      PYTHONPATH=$src$rest bench "ab[$v] quickstart $p b65536" --precision $p -- "${q[@]}" --batch_size 65536
      PYTHONPATH=$src$rest bench "ab[$v] criteo-1tb $p b65536" --precision $p -- "${c[@]}" --batch_size 65536
    done
  done
}

for phase in "$@"; do
  echo "===== $phase ($(date +%T))"
  "$phase"
done
exit $FAILED
