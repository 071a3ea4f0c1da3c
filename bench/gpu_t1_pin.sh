#!/usr/bin/env bash
# Issue 14 probe, one device call: does pinning the worker's threads to a few cores (and the
# caller to others) cut the Python time of each request? (bench/stream_overhead.py --pin over
# the CUDA worker and the bare echo; with loop-trip timelines.) Logs in $OUT/t1pin.tgz.
#   bench/gpu_t1_pin.sh        env: PINS ("none 2:8 2,3:8,9 2,3,4,5:8,9")
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1pin
for P in ${PINS:-none 2:8 2,3:8,9 2,3,4,5:8,9}; do
  arg=()
  [[ $P != none ]] && arg=(--pin "$P")
  timeout 90 python3 bench/stream_overhead.py --backend cuda --variants bare,servicer,worker \
    --rounds 2 --seconds 1 --inproc 0 --trips --timeline 14 "${arg[@]}" \
    >"$OUT/pin_${P//[:,]/_}.log" 2>&1
  echo "# pin $P rc=$? ($(elapsed))"
done
tar czf "$FINAL/t1pin.tgz" -C "$OUT" .
for f in "$OUT"/pin_*.log; do echo "== $f"; grep -E "median" "$f"; done
grep -A14 "^worker   loop" "$OUT"/pin_none.log "$OUT"/pin_2_3_8_9.log | cut -c1-220
