#!/usr/bin/env bash
# Issue 14 T1, session 8 (helper t1): one diagnostic device call (~70 s of command).
#  1. bench/loop_gap.py: the direct job's host path (launch_ieee + wait, T1's call) back to
#     back, and after a 300 us gap spent spinning, asleep, or asleep with the caches evicted
#  2. bench/stream_overhead.py --backend cuda: the bisection ladder from the bare echo to the
#     CUDA worker (echo + interceptor + decoding + coroutine writes; + the worker's options,
#     health/reflection, threads, tasks, heap, logging, imports; the servicer's direct path over
#     a stub engine; the Engine over a no-op backend; the CUDA worker), each with the client's
#     think time 0 and 100 us, with the replies' up/window/down stamps and per-thread counters
# $OUT gets t1bisect.tgz and summary.txt.   bench/gpu_t1_bisect.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1bisect
timeout 40 python3 bench/loop_gap.py --calls "${GAP_CALLS:-200}" --rounds 2 --gap 300 \
  >"$OUT/loop_gap.log" 2>&1
note "# loop_gap rc=$? ($(elapsed))"
E=bare+icpt+proto+coro
(cd bench && timeout 100 python3 stream_overhead.py --backend cuda --inproc 0 \
  --variants "bare,$E,$E+wopts+hr+threads+tasks+heap+log+imports,direct,engine,worker" \
  --think 0,100 --rounds 2 --seconds "${SECONDS_PER_RUN:-0.7}" --warmup 0.15 \
  >"$OUT/ladder.log" 2>&1)
note "# ladder rc=$? ($(elapsed))"
{
  echo "# gpu_t1_bisect $(cat COMMIT 2>/dev/null) $(elapsed)"
  cat "$OUT/loop_gap.log"
  grep -v "^# round" "$OUT/ladder.log" | tail -40
} >"$OUT/summary.txt"
tar czf "$FINAL/t1bisect.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
