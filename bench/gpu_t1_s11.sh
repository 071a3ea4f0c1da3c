#!/usr/bin/env bash
# Issue 14 T1, session 11: where the worker's transport excess over the bare echo comes from
# (one GPU machine, one device call; bench changes only, no product change to test).
# 1. bench/stream_overhead.py's ladder at T1's sizes, the worker's replies stamped: the bare
#    echo, the echo with the interceptor + decoding + the coroutine handler (a window of ~10 us),
#    the same holding each request 60 / 150 us in a busy wait (a window of that length and
#    nothing else), the CUDA worker, and the worker on gRPC's poll(2) poller; every run also
#    with KEEPERS spinning processes of the lowest priority beside (alternated): do idle CPUs
#    make the wake-ups slow?
# 2. T1 (bench/service.py --target-report, its floors measured in the same run) plain and with
#    the keepers running, alternated PAIRS times.
# $OUT gets summary.txt and t1s11.tgz (every log); progress.txt as it goes.
#   bench/gpu_t1_s11.sh      env: PAIRS (2), KEEPERS (nproc - 4), SECONDS_PER_RUN (1.5)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy PAIRS=1 KEEPERS=1 bench/gpu_t1_s11.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s11
BACKEND=${BACKEND:-cuda}
S=${SECONDS_PER_RUN:-1.5}
K=${KEEPERS:-$(($(nproc) - 4))}
{  # what the host's idle CPUs do
  uname -a; nproc; cat /proc/cmdline
  for f in /sys/devices/system/cpu/cpuidle/current_driver \
           /sys/devices/system/cpu/cpuidle/current_governor /sys/module/haltpoll/parameters/*; do
    echo "$f: $(cat "$f" 2>&1)"
  done
  grep -H . /sys/devices/system/cpu/cpu0/cpuidle/state*/name 2>&1 | head
  python3 -c "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); \
print('SCHED_IDLE allowed, policy now', os.sched_getscheduler(0))" 2>&1
} >"$OUT/host.txt" 2>&1
note "# host ($(elapsed)): $(head -1 "$OUT/host.txt" | cut -c1-80); keepers $K"
(cd bench && timeout 110 python3 stream_overhead.py --backend "$BACKEND" --inproc 0 \
  --rows 3584 --out f32 --keepers "$K" --rounds "${ROUNDS:-2}" --seconds 0.6 --warmup 0.15 \
  --variants bare,bare+icpt+proto+coro,bare+icpt+proto+coro+hold60,bare+icpt+proto+coro+hold150,worker,workerpoll) \
  >"$OUT/ladder.log" 2>&1
note "# ladder rc=$? ($(elapsed))"
KEEP_PIDS=()
keepers() {  # on|off: K spinning processes of the lowest priority
  if [[ $1 == on ]]; then
    for ((j = 0; j < K; j++)); do
      python3 -c "import os
os.nice(19)
try: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except OSError: pass
while True: pass" &
      KEEP_PIDS+=($!)
    done
  else
    for p in "${KEEP_PIDS[@]}"; do kill "$p"; done
    wait "${KEEP_PIDS[@]}" 2>/dev/null
    KEEP_PIDS=()
  fi
}
t1() {  # label
  [[ $1 == keep* ]] && keepers on
  timeout 60 python3 bench/service.py --backend "$BACKEND" --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds "$S" --warmup 0.3 >"$OUT/$1.log" 2>&1
  local rc=$?
  [[ $1 == keep* ]] && keepers off
  note "# $1 rc=$rc ($(elapsed)): $(grep -E '^# T1 stream' "$OUT/$1.log" | cut -c1-100)"
}
for ((i = 1; i <= ${PAIRS:-2}; i++)); do
  if ((i % 2)); then t1 "plain$i"; t1 "keep$i"; else t1 "keep$i"; t1 "plain$i"; fi
done
{
  echo "# gpu_t1_s11 tree $(cat COMMIT 2>/dev/null) $(elapsed)"
  cat "$OUT/host.txt"
  grep -vE "^\s+threads" "$OUT/ladder.log" | grep -E "^[a-z#]" | cut -c1-230
  python3 bench/t1_table.py "$OUT" plain keep
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s11.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
