#!/usr/bin/env bash
# Measure our trainer on one CUDA GPU that has torch but no fbgemm-gpu/torchrec, from the
# repository root, with what bench/gpu_ship.py packed (issue #7). Layout it expects:
#
#   .gpu/fbgemm/fbgemm_gpu.tar.xz   slimmed fbgemm-gpu (python bench/gpu_ship.py WHEEL .gpu/fbgemm)
#   .gpu/whl/*.whl                  torchrec, tensordict, pyvers, iopath (pip download --no-deps)
#   .gpu/src/                       the torchrec_cloud package to measure (a copy of src/)
#
#   bash .gpu/bench/gpu_bench.sh info quickstart   # phases run in order; logs go to $OUT
#
# Phases: info (versions, nvidia-smi, NVML test), quickstart, criteo, profile_quickstart,
# profile_criteo, ab (AB_VARIANTS="base src": .gpu/src_base against .gpu/src, same machine),
# uvm (criteo-1tb with its full 40M-row tables, UVM-cached where GPU memory cannot hold them,
# against the capped tables all in GPU memory, and the planner's estimate: docs/plan.md).
set -u
OUT=${OUT:-/tmp/gpu_bench_out}
mkdir -p "$OUT"
G=.gpu
export CUDA_MODULE_LOADING=LAZY PYTHONUNBUFFERED=1 PYTHONPATH=$G/src:/tmp/site
STEPS=${STEPS:-50}
WARMUP=${WARMUP:-10}
# Criteo 1TB tables capped at CAP rows (5 tables of 40M do not fit 80 GB in fp32).
CAP=${CAP:-20000000}
CRITEO_ROWS=$(python3 -c "
sizes = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
         2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
print(','.join(str(min(s, $CAP)) for s in sizes))")
COMMON=(--synthetic random --no-progress --no-tensorboard)

setup() {
  [ -f /tmp/site/.done ] && return
  local t0=$SECONDS
  # Pure-Python wheels: unpacking is installing (pip would refuse torchrec's py311 tag on 3.12).
  python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('$G/whl/*.whl')]" || exit 1
  if command -v xz >/dev/null; then
    xz -T0 -dc $G/fbgemm/fbgemm_gpu.tar.xz | tar -x -C /tmp/site || exit 1
  else
    python3 -c "import tarfile; tarfile.open('$G/fbgemm/fbgemm_gpu.tar.xz').extractall('/tmp/site')" || exit 1
  fi
  touch /tmp/site/.done
  echo "setup: $((SECONDS - t0)) s"
}

# bench NAME [bench flags] -- [train flags]: one worker; BENCH line to stdout, log to $OUT.
bench() {
  local name=$1; shift
  local t0=$SECONDS
  echo "### $name: $*" >>"$OUT/bench.log"
  timeout "${RUN_TIMEOUT:-240}" python3 -m torchrec_cloud bench --worker ours --steps "$STEPS" --warmup "$WARMUP" "$@" \
    >"$OUT/run.log" 2>&1
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
    return 1
  fi
  rm -f "$OUT/run.log"
}

info() {
  nvidia-smi
  command -v xz zstd
  python3 -c "
import torch, fbgemm_gpu, torchrec, tensordict
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())
print('fbgemm_gpu', fbgemm_gpu.__version__, fbgemm_gpu.__file__)
print('torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '?', torchrec.__file__)
print('tensordict', tensordict.__version__)"
  # GPU-only tests (skipped on CPU machines).
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_prometheus.py \
    -k "gpu_gauges or own_gpu or cpu_machine" -rs 2>&1 | tail -5
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
  # The planner's view first (this GPU's memory): which tables it caches, its step estimate.
  local gib
  gib=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)')
  for bs in 65536 131072; do
    python3 -m torchrec_cloud plan --preset criteo-1tb --batch_size $bs --gpus_per_node 1 --gpu_memory "$gib" \
      --json >"$OUT/plan_b$bs.log" 2>&1
    tail -1 "$OUT/plan_b$bs.log" | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("plan b%s fits=%s kernels=%s estimated_step_ms=%s" % (sys.argv[1], r["fits"], r["kernels"], r["estimated_step_ms"]))
' "$bs" | tee -a "$OUT/results.txt"
  done
  for p in tf32 bf16; do
    for bs in 65536 131072; do
      bench "criteo-1tb(full, auto) $p b$bs" --precision $p -- --preset criteo-1tb --batch_size $bs "${COMMON[@]}"
      bench "criteo-1tb(full, auto, prefetch) $p b$bs" --precision $p -- --preset criteo-1tb --batch_size $bs \
        --prefetch_pipeline "${COMMON[@]}"
      bench "criteo-1tb(cap $CAP, fused) $p b$bs" --precision $p -- --preset criteo-1tb --batch_size $bs \
        --num_embeddings_per_feature "$CRITEO_ROWS" --embedding_kernel fused "${COMMON[@]}"
    done
  done
}

# A/B of source variants (.gpu/src_<name>, beside .gpu/src) on the same machine.
ab() {
  local q=(--preset quickstart "${COMMON[@]}")
  local c=(--preset criteo-1tb --num_embeddings_per_feature "$CRITEO_ROWS" "${COMMON[@]}")
  for p in ${AB_PRECISIONS:-bf16}; do
    for v in ${AB_VARIANTS:-base src}; do
      local src=$G/src_$v; [ "$v" = src ] && src=$G/src
      PYTHONPATH=$src:/tmp/site bench "ab[$v] quickstart $p b65536" --precision $p -- "${q[@]}" --batch_size 65536
      PYTHONPATH=$src:/tmp/site bench "ab[$v] criteo-1tb $p b65536" --precision $p -- "${c[@]}" --batch_size 65536
    done
  done
}

setup
for phase in "$@"; do
  echo "===== $phase ($(date +%T))"
  "$phase"
done
