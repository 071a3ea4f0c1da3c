#!/usr/bin/env bash
# (STAGING_WC, the write-combined staging of its wc variants, was removed after bundle A3: no effect.)
# Session 12, helper hp, bundle A3 (bound 40 s): what decides Y_CHUNKS' default (kernels/cuda/
# launch.py point 8) and x's write-combined staging (STAGING_WC), pair streams on (main's default).
# 1. bench/backend_wall.py staged, ONE process, variants alternated per (shape, N), 3 rounds, on
#    the shapes with a large y (14336x4096, Qwen's 18944x3584 gate/up) and 4096x14336 (1 MB of y
#    at N=64, where A2's chunks lost), N = 32, 64: off = main (64 MB slabs); slab = 512-row slabs;
#    on2 / on3 = 512-row slabs, Y_CHUNKS 2 / 3; wc = off with STAGING_WC=1; on2wc = on2 + wc.
# 2. bench/slab_ab.py on the 56 MB shapes (A2: 0.982-0.985 at N=64 with 512-row slabs; noise?),
#    5 rounds.   Tables last (the per-row lines, with the chunks' rows, in wall.log).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp12c
timeout 22 python3 bench/backend_wall.py --shapes 14336x4096,18944x3584,4096x14336 --ns 64,32 \
  --modes staged --calls 100 --rounds 3 --variants \
  'off;slab:SLAB_ROWS=512;on2:SLAB_ROWS=512,Y_CHUNKS=2;on3:SLAB_ROWS=512,Y_CHUNKS=3;wc:STAGING_WC=1;on2wc:SLAB_ROWS=512,Y_CHUNKS=2,STAGING_WC=1' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
cp "$OUT/wall.log" "$FINAL/" 2>/dev/null
timeout 12 python3 bench/slab_ab.py --shapes 18944x3584,3584x18944 --ns 64,1 --slab-rows 0,512 \
  --rounds 5 --iters 30 --json "$OUT/slab.json" >"$OUT/slab.log" 2>&1
note "slab rc=$? at $(elapsed)"
cp "$OUT/slab.log" "$FINAL/" 2>/dev/null
grep -v "^#" "$OUT/wall.log" | grep -E " (on2|on3|on2wc) chunks| off$" | head -24
grep -A40 "^# variants" "$OUT/wall.log" || tail -25 "$OUT/wall.log"
cat "$OUT/slab.log"
