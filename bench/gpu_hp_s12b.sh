#!/usr/bin/env bash
# (STAGING_WC, the write-combined staging of its wc variants, was removed after bundle A3: no effect.)
# Session 12, helper hp, bundle A2 (bound 70 s): the row-chunked y (kernels/cuda/launch.py point 8)
# 1. its GPU test (tests/kernels/test_cuda_backend_host.py -m gpu: 512-row slabs vs one slab,
#    plain and chunked, bit for bit, every kind of call);
# 2. bench/backend_wall.py on the 48 MB weights at N=16,64 (staged, graph), ONE process, the
#    variants alternated per (shape, N), 3 rounds: off = main's path (64 MB slabs: one slab);
#    slab = 512-row slabs, no chunks; on = 512-row slabs, Y_CHUNKS=4; on2 = Y_CHUNKS=2;
#    wc = main's path with x's staging write-combined (STAGING_WC=1); onwc = on + wc;
# 3. bench/slab_ab.py: AUTO's kernel time with 64 MB vs 512-row slabs (five >= 48 MB shapes +
#    3584x3584, N = 1, 8, 64; rotated copies; 3 rounds alternated).
# Tables last.   OUT=... bench/gpu_hp_s12b.sh
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp12b
timeout 18 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/kernels/test_cuda_backend_host.py >"$OUT/tests.log" 2>&1
note "tests rc=$? $(tail -1 "$OUT/tests.log") at $(elapsed)"
timeout 22 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64,16 \
  --modes staged,graph --calls 120 --rounds 3 --variants \
  'off;slab:SLAB_ROWS=512;on:SLAB_ROWS=512,Y_CHUNKS=4;on2:SLAB_ROWS=512,Y_CHUNKS=2;wc:STAGING_WC=1;onwc:SLAB_ROWS=512,Y_CHUNKS=4,STAGING_WC=1' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 26 python3 bench/slab_ab.py --slab-rows 0,512 --rounds 3 --iters 30 \
  --json "$OUT/slab.json" >"$OUT/slab.log" 2>&1
note "slab rc=$? at $(elapsed)"
grep -A40 "^# variants" "$OUT/wall.log" || tail -25 "$OUT/wall.log"
cat "$OUT/slab.log"
