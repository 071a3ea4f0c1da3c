#!/usr/bin/env bash
# Session 10 (issue 16, helper k), device call 2: the K-slice tiles' split-K sum launched with
# programmatic dependent launch (Q6SERVE_PDL / Launcher.pdl). One call: its GPU test (same bits
# as the plain launch for the register, ring and wgmma tiles at several slice counts, directly
# and through the captured graph), then bench/tile_probe.py --pdl-ab: AUTO per shape and N with
# the sum launched plainly and with PDL, interleaved off/on/off/on in one process (the A/B);
# then --ks-sweep: src 4's 8-token shapes at forced K-slice counts beside AUTO (N = 1, 4, 8 on
# the 48-56 MB shapes: the grid model's split was never swept there).
set -uo pipefail
export OUT=${OUT:-$PWD/out}
KSTEST_ARGS="-k pdl" KSTEST_TIMEOUT=${KSTEST_TIMEOUT:-70} bench/gpu_run.sh kstest
rc=$?
SKIP_INSTALL=1 TILE_TIMEOUT=${TILE_TIMEOUT:-100} TILE_ARGS="--pdl-ab --no-torch \
  --shapes ${PDL_SHAPES:-4096x14336,3584x18944,14336x4096,18944x3584,152064x3584} \
  --ns ${PDL_NS:-1,2,4,8,16,32,64}" bench/gpu_run.sh tile
grep -h "^# PDL" -A40 "$OUT/tile_probe.log"
cp "$OUT/tile_probe.log" "$OUT/pdl_ab.log"; cp "$OUT/tile_probe.json" "$OUT/pdl_ab.json"
SKIP_INSTALL=1 TILE_TIMEOUT=${SWEEP_TIMEOUT:-70} TILE_ARGS="--ks-sweep ${KS_COUNTS:-0,1,2,3,4,6,8,12,16} \
  --no-torch --shapes ${SWEEP_SHAPES:-4096x14336,3584x18944,14336x4096,18944x3584} \
  --ns ${SWEEP_NS:-1,4,8}" bench/gpu_run.sh tile
exit $rc
