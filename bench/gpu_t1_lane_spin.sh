#!/usr/bin/env bash
# Issue 15 stretch (helper t1, session 9), device call 2: does the lane caller's spin
# (client/lane.py spin_us) pay on the H200? Call 1 (bench/gpu_t1_lane.sh) saw -32 and +15 us of
# p50 - kernel in two rounds, with the worker's pre-job and job times moving with it: the
# spinning caller may share a physical core (SMT sibling) with the worker's loop. One tree,
# bench/lane_latency.py --backend cuda (ffn_down 3584x18944, N=1, one caller) with the
# breakdown and the check, spins alternated 0/1000 x3 in one worker:
#   free     no pinning (as call 1)
#   apart    the caller pinned to the last CPU, the worker (--cpus) to every CPU that is not it
#            or its SMT siblings (busy polling stays on: >= 8 cores)
# $OUT gets t1spin.tgz, progress.txt and summary.txt.   bench/gpu_t1_lane_spin.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1spin  # (DRY_RUN=1: a CPU rehearsal, gpu_lib.sh)
S=${SECONDS_PER_RUN:-0.7}
BACKEND=${BACKEND:-cuda}
last=$(($(nproc) - 1))
sib=$(cat "/sys/devices/system/cpu/cpu$last/topology/thread_siblings_list" 2>/dev/null || echo "$last")
rest=$(python3 -c "
import os, sys
away = set()
for part in sys.argv[1].split(','):
    lo, _, hi = part.partition('-')
    away |= set(range(int(lo), int(hi or lo) + 1))
print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - away)))" "$sib")
note "# cpus $(nproc), caller cpu $last (siblings $sib), worker cpus $rest"
lscpu 2>/dev/null | grep -E "^(Model name|Thread|Core|Socket|NUMA node)" >"$OUT/lscpu.txt"
lane() {  # label [lane_latency args...]
  local label=$1
  shift
  (cd bench && timeout 45 python3 lane_latency.py --backend "$BACKEND" --rows "${ROWS:-3584}" \
    --k "${K:-18944}" --paths lane --spins 0,1000,0,1000,0,1000 --stamps --check \
    --seconds "$S" --warmup 0.2 --label "$label" --json "$OUT/$label.json" "$@" \
    >"$OUT/$label.log" 2>&1)
  note "# $label rc=$? ($(elapsed))"
  grep -E "^lane|p50 us" "$OUT/$label.log" | tee -a "$FINAL/progress.txt"
}
lane free
lane apart --client-cpu "$last" --worker-cpus "$rest"
{
  echo "# gpu_t1_lane_spin $(cat COMMIT 2>/dev/null)" \
    "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)" \
    "$(date -u '+%F %H:%M') UTC, $(elapsed); caller cpu $last, worker cpus $rest"
  cat "$OUT/lscpu.txt"
  python3 bench/lane_table.py "$OUT"
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1spin.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
