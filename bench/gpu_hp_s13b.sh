#!/usr/bin/env bash
# Session 13, helper hp, bundle B (bound 50 s): what lands, against main's behaviour, one process.
# 1. GPU tests of the host path (the two-slab default bit-identical to one slab; chunks; busy
#    calls plain);
# 2. bench/backend_wall.py staged + graph, 14336x4096, 4096x14336 and 18944x3584 at N = 64, 32,
#    1, variants alternated, 3 rounds: `main` = one slab (no chunks: main's behaviour), `new` =
#    this tree's defaults (two slabs for the tall two, their own 2 chunks for a y >= 1.5 MiB
#    while idle);
# 3. where the staged launch's host time goes (--probe, the new defaults, one round): before the
#    graph launch, the graph launch call, y's way out, after it (4096x14336 N=64's launch took
#    55 us in bundle A against 15 at N=1);
# 4. the CUDA backend's tests that now load a two-slab weight (the 8192x1024 lm-head-like argmax
#    at N=256) or relayout / read back weights.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp13b
timeout 14 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
timeout 14 python3 bench/backend_wall.py --shapes 14336x4096,4096x14336,18944x3584 --ns 64,32,1 \
  --modes staged,graph --calls 100 --rounds 3 --variants 'main:SLAB_ROWS=20000;new' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 8 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64,1 --modes staged \
  --calls 100 --probe >"$OUT/probe.log" 2>&1
note "probe rc=$? at $(elapsed)"
timeout 9 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend.py -p no:cacheprovider \
  -k "lm_head_like or relayout_and_read or multi_slab" >"$OUT/tests2.log" 2>&1
note "tests2 rc=$? at $(elapsed): $(tail -1 "$OUT/tests2.log")"
cp "$OUT/tests.log" "$OUT/tests2.log" "$OUT/wall.log" "$OUT/wall.json" "$OUT/probe.log" "$FINAL/" \
  2>/dev/null
grep "staged" "$OUT/probe.log" | cut -c1-250
grep -A20 "^# variants" "$OUT/wall.log" || tail -20 "$OUT/wall.log"
