#!/usr/bin/env bash
# Session 21, helper hp (issue 14 goals 1-3); PHASE=a (bundle A, bound 100 s) or b (bundle B, 60 s).
# A:
# 0. bench/host_y_probe.py: the table's launch with y on the device (+ its DMA, + the copy
#    kernel) against y stored by the kernel straight into pinned host memory (the tall
#    weights' N=64 y: 3.7-4.8 MB, 70-93 us of DMA), GPU span and wall, bits compared.
# 1. The N=64/32 host wall's split rules on today's kernels (4096x14336 N=64 is src 8 since
#    session 20: 36.9 us unsplit vs two N=32 halves 55+), bench/backend_wall.py staged with the
#    bus floor, alternated per round: def (halves; 14336x4096 halves x 2 row chunks), alt (no
#    halves: 4096x14336 whole, 14336x4096 in 2 row chunks), one (nothing split), yd (point 11:
#    an idle call's f32 y of 512 KiB or more stored by the kernels into its pinned block).
# 2. point 11's GPU test (y bit for bit the plain call's).
# 3. T1 with every direct job and the reply window stamped (bench/job_stamps.py): today's
#    handler window per part, if time is left.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/hp21$PHASE"
SITE=$PWD/bench/trips_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-100}
  step probe 20 python3 bench/host_y_probe.py --shapes 14336x4096,18944x3584,4096x14336 \
    --ns 64,32 --iters 30 --json "$OUT/probe.json"
  step wall 30 python3 bench/backend_wall.py --shapes 14336x4096,4096x14336,18944x3584 \
    --ns 64,32 --modes staged --calls 200 --rounds 3 --floor --json "$OUT/wall.json" \
    --variants "def;alt:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0;one:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0,Y_CHUNKS=0;yd:Y_DIRECT_MIN=524288"
  step tests 15 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    tests/service/test_launch_split.py -k direct_y
  if left 20; then
    PYTHONPATH=$PP Q6SERVE_JOB_STAMPS=$OUT/js_t1.json step t1 18 python3 bench/service.py \
      --backend "${BACKEND:-cuda}" --target-report --targets T1 --modes stream \
      --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/t1.json"
  fi
  {
    echo "# hp bundle A, tree $(tree_commit), $(elapsed)"
    grep -vE "^\s*$" "$OUT/probe.log" | tail -8 | cut -c1-200
    grep -A26 "^# variants" "$OUT/wall.log" | cut -c1-200
    grep -E "floor|h2d|d2h" "$OUT/wall.log" | head -4 | cut -c1-200
    grep -E '^T1 |mean us|^# T1 stream' "$OUT/t1.log" | head -4 | cut -c1-200
    python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-230
    tail -1 "$OUT/tests.log" 2>/dev/null
    steps
  } | table
fi
exit 0
