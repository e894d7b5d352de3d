#!/usr/bin/env bash
# Install the pinned stack (torch + fbgemm + torchrec) and this package into a virtualenv.
#
#   bash scripts/install.sh            # into .venv, CPU or CUDA wheels chosen by nvidia-smi
#   VENV=/opt/venv bash scripts/install.sh
#   TORCHREC_CLOUD_DEVICE=cpu|cuda     # force the flavour
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu   # where torch comes from, if not PyPI
#   EXTRAS=report,deploy               # extras of this package to install (default: report,deploy,
#                                      # what the commands need; `make test` passes EXTRAS=test)
#
# Idempotent: a stamp in the venv records what was installed; a second run with the same
# pins, extras and flavour returns at once. The Dockerfiles run this same script.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$here/.venv}"
EXTRAS="${EXTRAS:-report,deploy}"

# shellcheck disable=SC1091
source <(grep -E '^[A-Z_]+=' "$here/requirements/stack.txt")

device="${TORCHREC_CLOUD_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
case "$device" in
  cpu) fbgemm="fbgemm-gpu-cpu==$FBGEMM_VERSION" ;;
  cuda) fbgemm="fbgemm-gpu==$FBGEMM_VERSION" ;;
  *) echo "install.sh: TORCHREC_CLOUD_DEVICE must be cpu or cuda, got '$device'" >&2; exit 2 ;;
esac

stamp_input="$(cat "$here/requirements/"*.txt "$here/pyproject.toml" "$here/scripts/install.sh"; echo "$device $EXTRAS ${TORCH_INDEX_URL:-}")"
stamp="$(printf '%s' "$stamp_input" | sha256sum | cut -d' ' -f1)"
if [ -f "$VENV/.torchrec-cloud-stamp" ] && [ "$(cat "$VENV/.torchrec-cloud-stamp")" = "$stamp" ]; then
  exit 0
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python="$candidate"; break; fi
  done
fi
echo "install.sh: installing torch $TORCH_VERSION + $fbgemm + torchrec $TORCHREC_VERSION ($device) into $VENV"
[ -x "$VENV/bin/python" ] || "$python" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# torch from TORCH_INDEX_URL with --index-url: that index is the only place pip looks in
# that step (--extra-index-url would let a package of the same name elsewhere win by version:
# dependency confusion). The CUDA fbgemm-gpu comes from the same index (built for its CUDA);
# the CPU build, fbgemm-gpu-cpu, from PyPI, in its own step.
torch_index=()
[ -n "${TORCH_INDEX_URL:-}" ] && torch_index=(--index-url "$TORCH_INDEX_URL")
fbgemm_index=()
[ "$device" = cuda ] && fbgemm_index=("${torch_index[@]}")
# Expected noise, filtered: file:// index entries without a page for a package, and the
# resolver's complaint that torchrec wants `fbgemm-gpu` (the CPU build has another name).
quiet() {
  grep -v -e "is ignored: it is neither" -e "requires fbgemm-gpu, which is not installed" \
          -e "dependency resolver does not currently take into account" || true
}
"${pip[@]}" "${torch_index[@]}" "torch==$TORCH_VERSION" 2>&1 | quiet
"${pip[@]}" "${fbgemm_index[@]}" "$fbgemm" 2>&1 | quiet
"${pip[@]}" --no-deps "torchrec==$TORCHREC_VERSION" 2>&1 | quiet
"${pip[@]}" -r "$here/requirements/torchrec-deps.txt" 2>&1 | quiet
"${pip[@]}" -e "$here[$EXTRAS]" 2>&1 | quiet

import_err="$(mktemp)"  # not a fixed /tmp name: another user could have placed it
trap 'rm -f "$import_err"' EXIT
if ! "$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec, torchrec_cloud" 2>"$import_err"; then
  echo "install.sh: the stack does not import (torch/fbgemm/torchrec must be the pinned pair):" >&2
  tail -5 "$import_err" >&2
  exit 1
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__" || {
  echo "install.sh: torch in $VENV is not $TORCH_VERSION; remove $VENV and run again" >&2; exit 1; }
# The CPU kernels (src/torchrec_cloud/speedups/cpu_kernels.c) are compiled for this machine now rather
# than by the first training process; without a C compiler training uses torch ops instead.
"$VENV/bin/python" -m torchrec_cloud.speedups.native >/dev/null \
  || echo "install.sh: CPU kernels not built (see above); CPU training falls back to torch ops" >&2
echo "$stamp" > "$VENV/.torchrec-cloud-stamp"
echo "install.sh: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
