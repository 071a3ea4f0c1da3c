#!/usr/bin/env bash
# Session 14, helper hp, bundle A (bound 70 s): one launch per multi-weight call (issue 14).
# 1. bench/backend_wall.py --many: q/k/v (3584x3584 + 2 x 512x3584) and gate/up (2 x 18944x3584)
#    at N = 1, 8, 64, f16 x, f32 y, x a fresh host array per call (the service's direct path),
#    three ways alternated in one process, 4 rounds: `parts` (each part's launch and wait in
#    turn: main's multi-weight direct path), `pipe` (parts launched behind each other:
#    Q6SERVE_MULTI_PIPELINE=1), `many` (CudaBackend.launch_many); wall, summed kernel, host; every
#    way's y's compared bit for bit with `parts`';
# 2. the GPU test of launch_many (bit-identical to each part's launch on every kind of call, f32,
#    f16 and bf16 y, N = 1, 8, 64, 300).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp14a
timeout 34 python3 bench/backend_wall.py --many qkv,gateup --ns 1,8,64 --calls 150 --rounds 4 \
  --json "$OUT/many.json" >"$OUT/many.log" 2>&1
note "many rc=$? at $(elapsed)"
timeout 22 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  -k "launch_many" >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
cp "$OUT/many.log" "$OUT/many.json" "$OUT/tests.log" "$FINAL/" 2>/dev/null
grep -B2 -A20 "^# multi-weight summary" "$OUT/many.log" || tail -25 "$OUT/many.log"
