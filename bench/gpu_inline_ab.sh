#!/usr/bin/env bash
# A/B of the worker's --inline-device-us on one GPU machine (issue 14): 0 (every batch on the
# device thread, as before) against the default (short batches on the event loop's thread when
# the device thread is idle). Per setting: bench/device_path.py at T2's shape (64 callers N=1)
# and T3's (8 callers N=64) on ffn_down, one caller N=1 on ffn_down through MatmulStream
# (T1-shaped), the lm-head target (8 callers N=64 top-64), and the 7B decode replay at S=1 and 8
# with multi-weight calls. $OUT gets one archive of every log and JSON and summary.txt (printed
# last). ~150 s after the install.
#   bench/gpu_inline_ab.sh        env: SECONDS_PER_RUN (1.5), SETTINGS ("0 3000")
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/inline_ab
S=${SECONDS_PER_RUN:-1.5}
for V in ${SETTINGS:-0 3000}; do
  # V: --inline-device-us, optionally :D = Q6SERVE_DEFER_KERNEL_US (kernels longer than D us
  # are launched on the loop and waited for on the device thread; default 200)
  U=${V%:*}
  [[ $V == *:* ]] && export Q6SERVE_DEFER_KERNEL_US=${V#*:} || unset Q6SERVE_DEFER_KERNEL_US
  T=u$U${Q6SERVE_DEFER_KERNEL_US:+d$Q6SERVE_DEFER_KERNEL_US}  # the runs' file tag
  t() {  # NAME TIMEOUT CMD...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$OUT/${T}_$name.log" 2>&1
    echo "# $T $name rc=$? at $(elapsed)"
  }
  t dev_t2 40 python3 bench/device_path.py --backend cuda --callers 64 --n 1 --seconds "$S" \
    --inline-us "$U" --json "$OUT/${T}_dev_t2.json"
  t dev_t3 40 python3 bench/device_path.py --backend cuda --callers 8 --n 64 --seconds "$S" \
    --inline-us "$U" --json "$OUT/${T}_dev_t3.json"
  t t1 40 python3 bench/service.py --backend cuda --weights ffn_down --hosts 1 --seqs 1 \
    --batching on --mode stream --seconds "$S" --warmup 0.3 --inline-device-us "$U" \
    --json "$OUT/${T}_t1.json"
  t lm_head 40 python3 bench/service.py --backend cuda --lm-head --mode stream --seconds "$S" \
    --warmup 0.3 --inline-device-us "$U" --json "$OUT/${T}_lm.json"
  t replay 90 python3 bench/service.py --backend cuda --replay --replay-seqs 1,8 --multi on \
    --seconds "$S" --warmup 0.3 --inline-device-us "$U" --json "$OUT/${T}_replay.json"
done
{
  echo "# gpu_inline_ab $(git log -1 --format=%h 2>/dev/null) total $(elapsed)"
  for f in "$OUT"/u*_dev_t*.log; do grep "^in-process" "$f"; done
  for f in "$OUT"/u*_t1.log "$OUT"/u*_lm_head.log "$OUT"/u*_replay.log; do
    echo "## $(basename "$f")"
    grep -E "p50|step|reply|rows/s" "$f" | tail -6
  done
} >"$OUT/summary.txt"
tar czf "$FINAL/inline_ab.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
