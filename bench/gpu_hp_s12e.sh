#!/usr/bin/env bash
# Session 12, helper hp, bundle B (bound 30 s, on main): the next step for the row-chunked y
# (kernels/cuda/launch.py point 8, off by default): weights in 2 slabs instead of 512-row slabs.
# 1. bench/slab_ab.py: AUTO's kernel, one 64 MB slab vs 2 slabs, 14336x4096 and 18944x3584 at
#    N = 1, 64 (rotated copies, 3 rounds alternated);
# 2. bench/backend_wall.py staged, 14336x4096 N=64, one process, alternated, 3 rounds: plain (one
#    slab, no chunks) vs two (2 slabs of 7168 rows, Y_CHUNKS=2).   Tables last.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp12e
timeout 11 python3 bench/slab_ab.py --shapes 14336x4096,18944x3584 --ns 1,64 --slab-rows 0,p2 \
  --rounds 3 --iters 20 --json "$OUT/slab.json" >"$OUT/slab.log" 2>&1
note "slab rc=$? at $(elapsed)"
timeout 11 python3 bench/backend_wall.py --shapes 14336x4096 --ns 64 --modes staged --calls 120 \
  --rounds 3 --variants 'plain;two:SLAB_ROWS=7168,Y_CHUNKS=2' --json "$OUT/wall.json" \
  >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
cp "$OUT/slab.log" "$OUT/wall.log" "$FINAL/" 2>/dev/null
grep -v "^#" "$OUT/wall.log" | grep "two chunks" | head -3
grep -A4 "^# variants" "$OUT/wall.log" || tail -12 "$OUT/wall.log"
cat "$OUT/slab.log"
