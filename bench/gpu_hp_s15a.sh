#!/usr/bin/env bash
# Session 15, helper hp, bundle A (bound 100 s): issue 14's host wall at N=64 on 4096x14336 (104.1
# us over the kernel at session 14's closing check, limit 100: ~64 us of serial bus around a 40 us
# one-wave kernel).
# 1. backend_wall.py staged + graph, 4096x14336 and 14336x4096 at N = 64, 32, 1, 3 rounds, one
#    process, variants alternated: `main`; `tok` (X_SPLIT_MIN 512 KiB: token halves, x's second
#    half uploaded beside the first half's kernels, the first half's y downloaded beside the
#    second's, each half's tile narrowed to its tokens); `tok8` (the same on the full call's tile);
#    `rows` (4096x14336 in two slabs with 2 row chunks and Y_CHUNK_MIN 0: y's first chunk
#    downloaded beside the second chunk's kernels); `cp4` (COPY_SPLIT_MIN 256 KiB: the backend's
#    own copy of an unstaged x in 4 parts at once, graph mode); --floor: the bus alone;
# 2. GPU tests: token halves bit-identical to the whole call (4096x14336, 3584x18944; direct,
#    capture, graph, cached; staged and copied x; f32/bf16 y; N = 64, 40, 16; beside a launch in
#    flight) with and without X_SPLIT_FIT.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp15a
timeout 45 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64,32,1 \
  --modes staged,graph --calls 100 --rounds 3 --floor \
  --variants 'main;tok:X_SPLIT_MIN=524288;tok8:X_SPLIT_MIN=524288,X_SPLIT_FIT=0;rows:SLAB_ROWS=-2,Y_CHUNKS=2,Y_CHUNK_MIN=0;cp4:COPY_SPLIT_MIN=262144' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 40 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py -p no:cacheprovider \
  -k "token_halves" -rA >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
cp "$OUT"/*.log "$OUT"/*.json "$FINAL/" 2>/dev/null
grep -E "^(PASSED|FAILED|ERROR)" "$OUT/tests.log"; tail -1 "$OUT/tests.log"
grep " floor " "$OUT/wall.log"
grep -A13 "^# variants" "$OUT/wall.log" || tail -14 "$OUT/wall.log"
