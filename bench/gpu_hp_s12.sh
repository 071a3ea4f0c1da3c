#!/usr/bin/env bash
# Session 12, helper hp (issue 14, N=64 host time of CudaBackend.matmul), bundle A: y's download
# beside the kernels by row-chunked launches (kernels/cuda/launch.py point 8, Y_CHUNKS).
# 1. the GPU test of it (tests/kernels/test_cuda_backend_host.py -m gpu: a weight in 512-row slabs
#    gives the one-slab weight's y bit for bit, plain and chunked, every kind of call);
# 2. bench/backend_wall.py on the 48 MB weights at N=16,64 (staged, graph, --floor), in ONE
#    process, the variants alternated per (shape, N), 3 rounds:
#      off  = main's path (the default 64 MB slabs: one slab, never chunked);
#      slab = the weight in 512-row slabs, no chunks (what smaller slabs cost the plain kernel);
#      on   = 512-row slabs, Y_CHUNKS=4;   on2 = 512-row slabs, Y_CHUNKS=2.
# Table last: host p50 (wall p50) per variant, median of the rounds, us; the chunks' rows are on
# the per-row lines above it. Bound: 70 s.   OUT=... bench/gpu_hp_s12.sh
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp12
pack() { tar czf "$FINAL/hp_s12.tgz" -C "$OUT" . 2>/dev/null; }
timeout 28 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/kernels/test_cuda_backend_host.py >"$OUT/tests.log" 2>&1
note "tests rc=$? $(tail -1 "$OUT/tests.log") at $(elapsed)"
pack
timeout 30 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64,16 \
  --modes staged,graph --floor --calls 150 --rounds 3 \
  --variants 'off;slab:SLAB_ROWS=512;on:SLAB_ROWS=512,Y_CHUNKS=4;on2:SLAB_ROWS=512,Y_CHUNKS=2' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
pack
cp "$OUT/wall.log" "$OUT/tests.log" "$FINAL/" 2>/dev/null
grep -A40 "^# variants" "$OUT/wall.log" || tail -25 "$OUT/wall.log"
