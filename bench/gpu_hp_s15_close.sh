#!/usr/bin/env bash
# Session 15, helper hp, closing add-on (bound 60 s): the token halves' default (launch.py point
# 10: X_SPLIT_MIN 1.5 MiB of x, at most 64 tokens) against the same tree with them off, one
# process, alternated, 3 rounds: backend_wall.py staged + graph on 4096x14336 (issue 14's N=64
# target), 3584x18944 (N=48/64 split, first measured here) and 14336x4096 (row chunks, not split),
# N = 64, 48, 32, 1. `off`'s kernel is the plain call's: wall(new) - kernel(off) is the host part
# against the unsplit kernel.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp15c
timeout 50 python3 bench/backend_wall.py --shapes 4096x14336,3584x18944,14336x4096 \
  --ns 64,48,32,1 --modes staged,graph --calls 100 --rounds 3 --variants 'new;off:X_SPLIT_MIN=0' \
  --json "$OUT/hp_wall.json" >"$OUT/hp_wall.log" 2>&1
note "hp wall rc=$? at $(elapsed)"
cp "$OUT"/*.log "$OUT"/*.json "$FINAL/" 2>/dev/null
grep -E "staged.* new tokens" "$OUT/hp_wall.log" | head -4
grep -A24 "^# variants" "$OUT/hp_wall.log" || tail -24 "$OUT/hp_wall.log"
