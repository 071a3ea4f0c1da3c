#!/usr/bin/env bash
# Session 16, helper hp, bundle A (bound 150 s): issue 14's host wall at N=64 on the 48 MB shapes
# (limit: kernel + 100 us; session 15's closing check: 4096x14336 99.9, 14336x4096 103-110).
# 1. backend_wall.py staged, 14336x4096, 4096x14336 and 18944x3584 at N = 64, 32, 1, 3 rounds, one
#    process, variants alternated per (shape, N): `main` (14336x4096 / 18944x3584: two row chunks
#    where the grid allows, y down as 2D column-block copies; 4096x14336: token halves); `ty`
#    (X_SPLIT_Y_MIN 1.5 MiB: a y that large in token halves before row chunks, its y down as two
#    contiguous token halves; 4096x14336 as main: an A/A); `tyr` (ty + X_SPLIT_ROWS: each half
#    in the weight's 2 row chunks, 4 parts, where the half's grid takes two rounds); `plain` (row
#    chunks off: 14336x4096 unsplit). --floor: the bus alone, y's download also as the chunks' 2D column blocks and as
#    token halves (1D and 2D); --parts: the GPU span split at the kernels' events and when the
#    first part's y has landed. Each row's y is checked bit for bit against the defaults' (rc 1 on
#    a difference).
# 2. GPU tests of launch.py's split calls: row chunks, token halves by x and by y bit-identical to
#    the whole call on every kind of call.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp16a
timeout 80 python3 bench/backend_wall.py --shapes 14336x4096,4096x14336,18944x3584 --ns 64,32,1 \
  --modes staged --calls 100 --rounds 3 --floor --parts \
  --variants 'main;ty:X_SPLIT_Y_MIN=1572864;tyr:X_SPLIT_Y_MIN=1572864,X_SPLIT_ROWS=1;plain:Y_CHUNKS=0' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py \
  tests/service/test_launch_split.py -p no:cacheprovider \
  -k "row_chunks_on_the_gpu or token_halves_on_the_gpu or halves_by_y_on_the_gpu" -rA -s \
  >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
cp "$OUT"/*.log "$OUT"/*.json "$FINAL/" 2>/dev/null
grep -E "^(PASSED|FAILED|ERROR)" "$OUT/tests.log"; tail -1 "$OUT/tests.log"
grep -E " floor |DIFFERS" "$OUT/wall.log"
grep -E "^ +14336x4096 +64 +staged" "$OUT/wall.log" | head -4
grep -E "^(PASSED|FAILED).*halves_by_y|parts " "$OUT/tests.log" | head -8
grep -A9 "^# variants" "$OUT/wall.log" || tail -14 "$OUT/wall.log"
