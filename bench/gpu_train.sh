#!/usr/bin/env bash
# `train` on one GPU at batch 65,536 with 0..N --data_workers (issue #7), from a checkout where
# scripts/install.sh ran (PYTHON and GPU_STAGING: bench/gpu_env.sh); WORKERS="0 default 4 8 12",
# KINDS="random planted" and TRAIN_FLAGS="--precision bf16" pick the runs. Without a CUDA GPU:
# `NOT RUN` and exit 3.
set -u
cd "$(dirname "$0")/.." || exit 2
. bench/gpu_env.sh
why=$(gpu_why_not)
if [ -n "$why" ]; then
  echo "NOT RUN gpu_train: $why"
  exit 3
fi
prepare_staging || exit 1
"$PYTHON" - <<'PY'
import time, torch
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.synthetic import SyntheticSource
for kind in ("random", "planted"):
    cfg = parse_job_config(["--preset", "quickstart", "--synthetic", kind, "--batch_size", "65536"])
    s = SyntheticSource(cfg, 0, 1)
    s.make_batch("train", 0)
    t0 = time.perf_counter()
    for i in range(5):
        b = s.make_batch("train", i)
    t1 = time.perf_counter()
    b.pin_memory()
    t2 = time.perf_counter()
    print(f"make_batch quickstart {kind} b65536: {(t1-t0)/5*1e3:.1f} ms; pin_memory {1e3*(t2-t1):.1f} ms; threads {torch.get_num_threads()}")
PY
for kind in ${KINDS:-random planted}; do
for p in ${WORKERS:-0 default 4 8 12}; do
  out=/tmp/tr_${kind}_$p
  timeout 150 "$PYTHON" -m torchrec_cloud train --preset quickstart --synthetic $kind --batch_size 65536 \
    --num_batches_per_epoch 80 --num_eval_batches 1 --log_every 20 $( [ $p = default ] || echo --data_workers $p ) ${TRAIN_FLAGS:-} \
    --no-progress --no-tensorboard --output_dir $out > $out.log 2>&1 || { echo "FAILED $kind $p"; tail -20 $out.log; continue; }
  "$PYTHON" -c "
import json
r = [json.loads(l) for l in open('$out/metrics.jsonl')]
t = [x for x in r if x['event'] == 'train']
last = t[-1]
print('train quickstart $kind b65536 data_workers=$p ${TRAIN_FLAGS:-}', 'samples/s %.0f' % last['samples_per_s'], 'data_wait_ms %.1f' % (1e3*last['data_wait_s']), 'step_ms %.1f' % (1e3*last['step_s']), 'fwd_bwd_opt_ms %.1f' % (1e3*last['fwd_bwd_opt_s']), 'test_auc', [x['auc'] for x in r if x['event']=='eval'][-1])"
done
done
