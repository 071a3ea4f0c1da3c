#!/usr/bin/env bash
# Session 21, helper hp (issue 14 goals 1-3); PHASE=a (bundle A, bound 100 s) or b (bundle B, 60 s).
# A:
# 0. bench/host_y_probe.py: the table's launch with y on the device (+ its DMA, + the copy
#    kernel) against y stored by the kernel straight into pinned host memory (the tall
#    weights' N=64 y: 3.7-4.8 MB, 70-93 us of DMA), GPU span and wall, bits compared.
# 1. The N=64 host wall's split rules on today's kernels (4096x14336 N=64 is src 8 since session
#    20: 36.9 us unsplit vs two N=32 halves 55+), bench/backend_wall.py staged with the bus floor
#    and --parts, alternated per round: def (halves; 14336x4096 halves x 2 row chunks), alt (no
#    halves: 4096x14336 whole, 14336x4096 in 2 row chunks), r4 (alt, 14336x4096 in 4 slabs and 4
#    row chunks), one (nothing split).
# 2. T1 with every direct job and the reply window stamped (bench/job_stamps.py): today's
#    handler window per part.
# 3. The 2-layer replay at S=1 with the caller's loop spinning 1000 us (longer than a call's round
#    trip) against a plain caller, alternated (goal 3), if time is left.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/hp21$PHASE"
SITE=$PWD/bench/trips_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-100}
  step probe 25 python3 bench/host_y_probe.py --shapes 14336x4096,18944x3584,4096x14336 \
    --ns 64,32 --iters 40 --json "$OUT/probe.json"
  step wall 30 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64 \
    --modes staged --calls 200 --rounds 3 --floor --parts --json "$OUT/wall.json" \
    --variants "def;alt:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0;r4:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0,SLAB_ROWS=-4,Y_CHUNKS=4;one:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0,Y_CHUNKS=0"
  PYTHONPATH=$PP Q6SERVE_JOB_STAMPS=$OUT/js_t1.json step t1 18 python3 bench/service.py \
    --backend "${BACKEND:-cuda}" --target-report --targets T1 --modes stream --weights ffn_down \
    --seconds 1.2 --warmup 0.3 --json "$OUT/t1.json"
  if left 14; then
    step spin "$(bound 30 2)" python3 bench/service.py --backend "${BACKEND:-cuda}" --replay \
      --layers 2 --replay-seqs 1 --multi on --replay-spins 0,1000,0,1000 --seconds 1.0 \
      --warmup 0.3 --no-replay-floor --json "$OUT/spin.json"
  fi
  {
    echo "# hp bundle A, tree $(tree_commit), $(elapsed)"
    grep -vE "^\s*$" "$OUT/probe.log" | tail -8 | cut -c1-200
    grep -A12 "^# variants" "$OUT/wall.log" | cut -c1-200
    grep -E "floor|h2d|d2h" "$OUT/wall.log" | head -4 | cut -c1-200
    grep -E '^T1 |mean us|^# T1 stream' "$OUT/t1.log" | head -4 | cut -c1-200
    python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-230
    grep -E "step|spin" "$OUT/spin.log" 2>/dev/null | tail -8 | cut -c1-200
    steps
  } | table
fi
exit 0
