#!/usr/bin/env bash
# Session 13, helper hp, bundle A (bound 70 s): issue 14's host time at N=64 on the 48 MB weights.
# 1. GPU tests of the host path: the default two-slab 14336x4096 (its own 2 row chunks), 512-row
#    slabs with 4 chunks, and a busy call (plain) give the one-slab weight's y bit for bit;
# 2. bench/backend_wall.py staged + graph, 14336x4096, 4096x14336 and 18944x3584 at N = 64, 32,
#    16, 1, one process, variants alternated, 3 rounds: `one` = main (one slab, no chunks), `new`
#    = this tree's default (two slabs for 14336x4096 and 18944x3584, their own 2 chunks where the
#    tile takes them; 4096x14336 is `one` again: a control), `xa` = new + every x uploaded by a
#    copy before the graph launch (X_APART_MIN 1), `hp` = new + x's staging on 2 MiB huge pages
#    (STAGING_HUGE; registered with CUDA). The staged wall is launch..wait now; `loop`
#    is the old figure (with the bench's span events). --floor: x's upload, y's download alone.
# 3. bench/slab_ab.py: AUTO's kernel, one slab vs storage's default (two) at N = 8, 16, 32 (N=1
#    and 64 were measured by the session's first call).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp13a
timeout 22 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
timeout 33 python3 bench/backend_wall.py --shapes 14336x4096,4096x14336,18944x3584 \
  --ns 64,32,16,1 --modes staged,graph --calls 100 --rounds 3 --floor \
  --variants 'one:SLAB_ROWS=20000;new;xa:X_APART_MIN=1;hp:STAGING_HUGE=1' --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 10 python3 bench/slab_ab.py --shapes 14336x4096,18944x3584 --ns 8,16,32 \
  --slab-rows 20000,0 --rounds 3 --iters 20 --json "$OUT/slab.json" >"$OUT/slab.log" 2>&1
note "slab rc=$? at $(elapsed)"
cp "$OUT/tests.log" "$OUT/wall.log" "$OUT/wall.json" "$OUT/slab.log" "$FINAL/" 2>/dev/null
grep -E "floor" "$OUT/wall.log" | head -12
grep -A40 "^# variants" "$OUT/wall.log" || tail -20 "$OUT/wall.log"
cat "$OUT/slab.log"
