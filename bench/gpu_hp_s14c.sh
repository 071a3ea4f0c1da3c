#!/usr/bin/env bash
# Session 14, helper hp, bundle C (bound 40 s): the GPU tests bundle B cut at its 11 s (compile
# time): launch_many bit-identical to each part's launch on every kind of call with a new x each
# call (q/k/v, gate/up; f32, f16, bf16 y; N = 1, 8, 64, 300), and x staged in write-combined
# memory bit-identical (4096x14336 N = 64, 32, 1; staged and copied x).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp14c
timeout 32 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  -k "launch_many or write_combined" -rA >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
cp "$OUT/tests.log" "$FINAL/" 2>/dev/null
grep -E "^(PASSED|FAILED|ERROR)" "$OUT/tests.log"; tail -1 "$OUT/tests.log"
