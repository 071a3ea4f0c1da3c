#!/usr/bin/env bash
# (Ran at fdbe634 in bundle A, 2026-12-02 06:09 UTC; the xa and hp variants' constants, X_APART_MIN and
# STAGING_HUGE, were removed after it: no gain. bench/RESULTS.md, host path session 13.)
# Session 13, helper hp, bundle A (bound 70 s): issue 14's host time at N=64 on the 48 MB weights,
# on main's table re-tuned for pair weights (d7d6f1b: N=64 left the wgmma tile, src 4 now).
# 1. GPU tests of the host path: the default two-slab 14336x4096 (its own 2 row chunks), 512-row
#    slabs with 4 chunks, and a busy call (plain) give the one-slab weight's y bit for bit; the
#    huge-page staging gives the default's bits;
# 2. bench/backend_wall.py staged, 14336x4096, 4096x14336 and 18944x3584 at N = 64, 32, 16, 1,
#    one process, variants alternated, 3 rounds: `one` = main (one slab, no chunks), `new` =
#    this tree's default (two slabs and their own 2 chunks for 14336x4096 and 18944x3584;
#    4096x14336 is `one` again), `two` = every weight in 2 slabs with 2 chunks (4096x14336 on
#    the register K-slice tile now), `xa` = new + every x uploaded by a copy before the graph
#    launch (X_APART_MIN 1), `hp` = new + x's staging on 2 MiB huge pages (STAGING_HUGE). The
#    staged wall is launch..wait now; `loop` is the old figure (with the bench's span events).
#    --floor: x's upload and y's download alone.
# 3. bench/slab_ab.py: AUTO's kernel, one slab vs two at N = 64, 32, 16, 8, 1 (new table).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp13a
timeout 20 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
timeout 28 python3 bench/backend_wall.py --shapes 14336x4096,4096x14336,18944x3584 \
  --ns 64,32,16,1 --modes staged --calls 100 --rounds 3 --floor \
  --variants 'one:SLAB_ROWS=20000;new;two:SLAB_ROWS=-2,Y_CHUNKS=2;xa:X_APART_MIN=1;hp:STAGING_HUGE=1' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 14 python3 bench/slab_ab.py --shapes 14336x4096,18944x3584,4096x14336 --ns 64,32,16,8,1 \
  --slab-rows 20000,p2 --rounds 3 --iters 20 --json "$OUT/slab.json" >"$OUT/slab.log" 2>&1
note "slab rc=$? at $(elapsed)"
cp "$OUT/tests.log" "$OUT/wall.log" "$OUT/wall.json" "$OUT/slab.log" "$FINAL/" 2>/dev/null
grep -E "floor" "$OUT/wall.log" | head -12
grep -A40 "^# variants" "$OUT/wall.log" || tail -20 "$OUT/wall.log"
cat "$OUT/slab.log"
