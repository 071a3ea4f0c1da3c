#!/usr/bin/env bash
# Issue 14 T1, session 9 (helper t1): does grpc's synchronous server serve T1 faster than the
# worker's grpc.aio one? One device call (~80 s after the machine's start), all on one machine:
#  1. bench/stream_overhead.py --backend cuda at T1's sizes (ffn_down K=18944 f16 x, 3584 f32 y),
#     think 0 and 50 us (the T1 caller's encode + decode between round trips is ~45 us):
#       bare       the aio bytes echo (T1's floor)        bare+spin  the same, loop busy-polling
#       sbare      the sync server's bytes echo            sync       sync-server MatmulStream
#       worker     the real CUDA worker (busy polling on)  worker0    the same, busy polling off
#     (sync: request decoded, the worker's direct job -- launch_ieee + wait on the CUDA
#     backend -- on the handler thread, reply encoded; worker, sync: minus the kernel's events)
#  2. T1 as the closing check runs it (bench/service.py --target-report --targets T1 --modes
#     stream --weights ffn_down), busy polling on (default) and off (Q6SERVE_BUSY_POLL_US=0)
# $OUT gets t1sync.tgz and summary.txt.   bench/gpu_t1_sync.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1sync
S=${SECONDS_PER_RUN:-1.0}
(cd bench && timeout "${OVERHEAD_LIMIT:-80}" python3 stream_overhead.py --backend cuda --inproc 0 \
  --variants bare,bare+spin,sbare,sync,worker,worker0 --k 18944 --rows 3584 --out f32 \
  --think 0,50 --rounds "${ROUNDS:-2}" --seconds 0.8 --warmup 0.2 >"$OUT/overhead.log" 2>&1)
note "# stream_overhead rc=$? ($(elapsed))"
t1() {  # label [env...]
  local label=$1
  shift
  env "$@" timeout 45 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds "$S" --warmup 0.3 \
    --json "$OUT/t1_$label.json" >"$OUT/t1_$label.log" 2>&1
  note "# T1 $label rc=$? ($(elapsed)): $(grep -E '^# T1 stream' "$OUT/t1_$label.log")"
}
t1 spin
t1 nospin Q6SERVE_BUSY_POLL_US=0
{
  echo "# gpu_t1_sync $(cat COMMIT 2>/dev/null) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u '+%F %H:%M') UTC, $(elapsed)"
  for l in spin nospin; do
    echo "## T1 busy polling $l"
    grep -E "^# bare gRPC|mean us|^# T1 stream" "$OUT/t1_$l.log" | cut -c1-300
    grep -oE '"p50_minus_kernel_us": [0-9.]+|"bare_grpc_p50_us": [0-9.]+|"bare_grpc_client_work_p50_us": [0-9.]+' \
      "$OUT/t1_$l.log" | tr '\n' ' '
    echo
  done
  echo "## stream_overhead at T1's sizes (p50 us; worker*, sync: minus the kernel)"
  grep -vE "^# round|^# spin|^# work" "$OUT/overhead.log" | grep -E "median|threads|^#" | cut -c1-260
} >"$OUT/summary.txt"
tar czf "$FINAL/t1sync.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
