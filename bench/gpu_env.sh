# Sourced from the repository root by bench/gpu_bench.sh, gpu_check.sh and gpu_train.sh: the
# Python they run, with this checkout's src/ first on its path.
#
#   PYTHON       default .venv/bin/python (what scripts/install.sh made); python3 with GPU_STAGING
#   GPU_STAGING  optional, for a GPU machine that cannot install (no network, size-limited
#                transfers): a folder holding fbgemm/fbgemm_gpu.tar.xz (bench/gpu_ship.py) and
#                whl/*.whl (torchrec and its pure-Python needs), unpacked once into GPU_SITE
#                (default /tmp/site) and put on the path after src/
export CUDA_MODULE_LOADING=LAZY PYTHONUNBUFFERED=1
if [ -n "${GPU_STAGING:-}" ]; then
  PYTHON=${PYTHON:-python3}
  GPU_SITE=${GPU_SITE:-/tmp/site}
  export PYTHONPATH=$PWD/src:$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}
else
  PYTHON=${PYTHON:-.venv/bin/python}
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi

# Why nothing can run on a GPU here (one line), or nothing where $PYTHON's torch sees one.
gpu_why_not() {
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "no $PYTHON (run bash scripts/install.sh, or set PYTHON)"
    return
  fi
  local count
  if ! count=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null); then
    echo "torch does not load in $PYTHON"
    return
  fi
  [ "${count:-0}" -gt 0 ] 2>/dev/null || echo "no CUDA GPU visible (torch.cuda.device_count() == 0)"
}

# Unpack GPU_STAGING into GPU_SITE once (nothing to do without GPU_STAGING).
prepare_staging() {
  [ -n "${GPU_STAGING:-}" ] || return 0
  [ -f "$GPU_SITE/.done" ] && return 0
  local packed=$GPU_STAGING/fbgemm/fbgemm_gpu.tar.xz t0=$SECONDS
  if [ ! -f "$packed" ] || ! ls "$GPU_STAGING"/whl/*.whl >/dev/null 2>&1; then
    echo "GPU_STAGING=$GPU_STAGING has no fbgemm/fbgemm_gpu.tar.xz or whl/*.whl (bench/gpu_ship.py makes them)" >&2
    return 1
  fi
  mkdir -p "$GPU_SITE" || return 1
  # Pure-Python wheels: unpacking them is installing them (no pip, no network).
  "$PYTHON" -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[2] + '/whl/*.whl')]" \
    "$GPU_SITE" "$GPU_STAGING" || return 1
  if command -v xz >/dev/null; then
    xz -T0 -dc "$packed" | tar -x -C "$GPU_SITE" || return 1
  else
    "$PYTHON" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$packed" "$GPU_SITE" || return 1
  fi
  touch "$GPU_SITE/.done"
  echo "staging $GPU_STAGING unpacked into $GPU_SITE in $((SECONDS - t0)) s"
}
