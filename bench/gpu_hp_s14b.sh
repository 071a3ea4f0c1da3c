#!/usr/bin/env bash
# (Ran at 7ef62fd in bundle B, 2026-12-02 ~09:05 UTC; MANY_APART_MIN was removed after it: no gain.
# bench/RESULTS.md, host path session 14.)
# Session 14, helper hp, bundle B (bound 50 s): launch_many's large y part by part, its f16 y, and
# x staged in write-combined memory.
# 1. GPU tests: launch_many bit-identical to each part's launch on every kind of call (a new x
#    each call, MANY_APART_MIN 0 and 1 MiB); write-combined staging bit-identical;
# 2. bench/backend_wall.py --many q/k/v and gate/up at N = 1, 8, 64, f32 y, 2 rounds alternated:
#    parts, pipe, `many:one` (MANY_APART_MIN 0: one download after every part, the default) and
#    `many:apart` (1 MiB: each part's y DMA'd on the copy stream once its kernels are done, beside
#    the next part's);
# 3. backend_wall.py staged + graph, 4096x14336 and 14336x4096 at N = 64, 32, 2 rounds: `main` vs
#    `wc` (STAGING_WC_MIN 256 KiB: x's staging buffer write-combined; the issue-14 N=64 target's
#    4096x14336 misses by 3-7 us);
# 4. --many at N = 1, 8 with f16 y (the replay's --replay-out), parts / pipe / many.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp14b
timeout 11 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  -k "launch_many or write_combined" >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
timeout 13 python3 bench/backend_wall.py --many qkv,gateup --ns 1,8,64 --calls 100 --rounds 2 \
  --variants 'one:MANY_APART_MIN=0;apart:MANY_APART_MIN=1048576' --json "$OUT/many.json" \
  >"$OUT/many.log" 2>&1
note "many rc=$? at $(elapsed)"
timeout 12 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64,32 \
  --modes staged,graph --calls 100 --rounds 2 --variants 'main;wc:STAGING_WC_MIN=262144' \
  --json "$OUT/wc.json" >"$OUT/wc.log" 2>&1
note "wc rc=$? at $(elapsed)"
timeout 6 python3 bench/backend_wall.py --many qkv,gateup --ns 1,8 --calls 100 --rounds 2 \
  --many-out f16 --json "$OUT/many16.json" >"$OUT/many16.log" 2>&1
note "many16 rc=$? at $(elapsed)"
cp "$OUT"/*.log "$OUT"/*.json "$FINAL/" 2>/dev/null
grep -A6 "^# multi-weight summary" "$OUT/many16.log" || tail -6 "$OUT/many16.log"
grep -A9 "^# variants" "$OUT/wc.log" || tail -10 "$OUT/wc.log"
grep -A8 "^# multi-weight summary" "$OUT/many.log" || tail -10 "$OUT/many.log"
