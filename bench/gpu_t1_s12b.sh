#!/usr/bin/env bash
# Issue 14 T1, session 12, bundle A2 (bound 45 s). Bundle A found T1's way up + down growing with
# the server's window and not with the worker's code: the spinning echo rung (the worker's
# interceptor, decoding, coroutine handler, busy polling) holding each request 200 us in a busy
# wait had up + down 441 us against 344 without the hold, the CUDA worker (window ~190 with its
# kernel) 457. Is it the wake-up of threads that idled longer (CPUs gone idle: a VM's halt)? A
# hold sweep (0, 100, 200, 300 us), the bare echo busy-polling (the T1 limit's floor) and the CUDA
# worker, each also run beside 12 spinning
# SCHED_IDLE processes that keep the CPUs from idling (stream_overhead --keepers, alternated),
# and the guest's idle settings. Bench only.
#   bench/gpu_t1_s12b.sh      a CPU rehearsal: DRY_RUN=1 BACKEND=numpy bench/gpu_t1_s12b.sh
# $OUT: t1s12b.tgz (logs), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s12b
for f in /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor \
  /sys/module/haltpoll/parameters/* /sys/module/cpuidle_haltpoll/parameters/* \
  /sys/devices/system/cpu/cpu0/cpuidle/state*/name; do
  [[ -r $f ]] && echo "$f: $(cat "$f")"
done >"$OUT/idle.txt" 2>&1
echo "cpus $(nproc)" >>"$OUT/idle.txt"
R=bare+icpt+proto+coro+spin
(cd bench && timeout 37 python3 stream_overhead.py --backend "${BACKEND:-cuda}" --inproc 0 --rows 3584 \
  --out f32 --rounds 2 --seconds "${SECONDS_PER:-0.5}" --warmup 0.15 --keepers 12 \
  --variants "bare+spin,$R,$R+hold100,$R+hold200,$R+hold300,worker") >"$OUT/sweep.log" 2>&1
note "# sweep rc=$? ($(elapsed))"
{
  echo "# gpu_t1_s12b tree $(cat COMMIT 2>/dev/null) ($(elapsed))"
  cat "$OUT/idle.txt"
  grep -E "^# (round|keepers)" "$OUT/sweep.log"
  echo "# variant: p50 us (worker: minus the kernel), up, window, down, up + down"
  grep -E "^[a-z][^ ]* +median " "$OUT/sweep.log" | sed "s/^$R/R/" | awk '{
    u = w = d = "-"
    for (i = 1; i <= NF; i++) { if ($i == "up") u = $(i + 1); if ($i == "window") w = $(i + 1);
      if ($i == "down") d = $(i + 1) }
    printf "%-16s p50 %5s  up %4s  window %4s  down %4s  up+down %4s\n", $1, $3, u, w, d,
      (u == "-" ? "-" : u + d) }'
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s12b.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
