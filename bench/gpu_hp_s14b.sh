#!/usr/bin/env bash
# Session 14, helper hp, bundle B (bound 50 s): launch_many's large y part by part, and its f16 y.
# 1. the GPU test of launch_many (bit-identical to each part's launch on every kind of call, a new
#    x each call, MANY_APART_MIN 0 and 1 MiB);
# 2. bench/backend_wall.py --many q/k/v and gate/up at N = 1, 8, 64, f32 y, 3 rounds alternated:
#    parts, pipe, `many:one` (MANY_APART_MIN 0: one download after every part, the default) and
#    `many:apart` (1 MiB: each part's y DMA'd on the copy stream once its kernels are done, beside
#    the next part's);
# 3. the same at N = 1, 8 with f16 y (the replay's --replay-out), parts / pipe / many.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp14b
timeout 12 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  -k "launch_many" >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
timeout 18 python3 bench/backend_wall.py --many qkv,gateup --ns 1,8,64 --calls 120 --rounds 3 \
  --variants 'one:MANY_APART_MIN=0;apart:MANY_APART_MIN=1048576' --json "$OUT/many.json" \
  >"$OUT/many.log" 2>&1
note "many rc=$? at $(elapsed)"
timeout 9 python3 bench/backend_wall.py --many qkv,gateup --ns 1,8 --calls 120 --rounds 3 \
  --many-out f16 --json "$OUT/many16.json" >"$OUT/many16.log" 2>&1
note "many16 rc=$? at $(elapsed)"
cp "$OUT/tests.log" "$OUT/many.log" "$OUT/many.json" "$OUT/many16.log" "$OUT/many16.json" \
  "$FINAL/" 2>/dev/null
grep -A8 "^# multi-weight summary" "$OUT/many16.log" || tail -8 "$OUT/many16.log"
grep -A10 "^# multi-weight summary" "$OUT/many.log" || tail -12 "$OUT/many.log"
