#!/usr/bin/env bash
# Session 13, helper hp, bundle A (bound 70 s): issue 14's host time at N=64 on the 48 MB weights.
# 1. GPU tests of the host path: the default two-slab 14336x4096 (its own 2 row chunks), 512-row
#    slabs with 4 chunks, and a busy call (plain) give the one-slab weight's y bit for bit;
# 2. bench/backend_wall.py staged + graph, 14336x4096 and 4096x14336 at N = 64, 32, 1, one
#    process, variants alternated, 3 rounds: `one` = main (one slab, no chunks), `new` = this
#    tree's default (two slabs and 2 chunks for 14336x4096; 4096x14336 is `one` again: a
#    control), `xa` = new + x uploaded by a copy before the graph launch (X_APART_MIN 256 KiB),
#    `xa1` = the same for every x (N=1 too). The staged wall is launch..wait now; `loop` is the
#    old figure (with the bench's span events). --floor: x's upload, y's download alone.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp13a
timeout 25 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
timeout 38 python3 bench/backend_wall.py --shapes 14336x4096,4096x14336 --ns 64,32,1 \
  --modes staged,graph --calls 100 --rounds 3 --floor \
  --variants 'one:SLAB_ROWS=16384;new;xa:X_APART_MIN=262144;xa1:X_APART_MIN=1' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
cp "$OUT/tests.log" "$OUT/wall.log" "$OUT/wall.json" "$FINAL/" 2>/dev/null
grep -E "floor" "$OUT/wall.log" | head -6
grep -A40 "^# variants" "$OUT/wall.log" || tail -20 "$OUT/wall.log"
