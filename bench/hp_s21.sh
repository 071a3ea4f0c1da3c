#!/usr/bin/env bash
# Session 21, helper hp (issue 14 goals 1-3); PHASE=b (bundle B, bound 60 s), c (bundle C, 60 s).
# Bundle A ran PHASE=a at d923d21 (branch hp-ydirect-s21: the probe bench/host_y_probe.py, the
# N=64/32 split rules def / alt / one and point 11's y stored by the kernels into host memory,
# yd, which lost and is not on this branch; docs/SERVICE.md has the figures).
# B:
# 1. Where the unsplit N=64 call's launch goes (4096x14336: the host's launch 27-45 us before the
#    GPU starts x's 1.8 MB upload, 14336x4096's 13): bench/backend_wall.py staged --probe (the
#    Python before the graph launch, cuGraphLaunch, y's way out), alternated per round: def; one
#    (nothing split); ck (a candidate default: x up by the copy kernel up to 2 MiB, no memcpy
#    node in the graph, and token halves by x only past 2 MiB: 4096x14336 N=64 whole, 3584x18944
#    N=64's 2.4 MB still in halves, its N=32's 1.2 MB by the kernel); r4 (14336x4096 in 4 slabs
#    and 4 row chunks, no halves).
# 2. bench/graph_launch_probe.py: Graph.launch's host time for one H2D memcpy node against the
#    copy kernel, 64 KiB .. 3.5 MiB, with the staging buffer just filled or not.
# 3. Goal 3: the 2-layer replay at S=1 with the caller's loop spinning 1000 us (longer than a
#    call's round trip) against a plain caller, alternated 0,1000,0,1000.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-b}
gpu_session "/tmp/hp21$PHASE"
if [[ $PHASE == b ]]; then
  BOUND=${BOUND:-60}
  step wall 22 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096,3584x18944 \
    --ns 64,32 --modes staged --probe --calls 200 --rounds 3 --json "$OUT/wall.json" \
    --variants "def;one:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0,Y_CHUNKS=0;ck:X_SPLIT_MIN=2097153,COPY_KERNEL_MAX=2097152;r4:X_SPLIT_MIN=0,X_SPLIT_Y_MIN=0,SLAB_ROWS=-4,Y_CHUNKS=4"
  step glp 10 python3 bench/graph_launch_probe.py --calls 200 --json "$OUT/glp.json"
  if left 15; then
    step spin "$(bound 35 2)" python3 bench/service.py --backend "${BACKEND:-cuda}" --replay \
      --layers 2 --replay-seqs 1 --multi on --replay-spins 0,1000,0,1000 --seconds 1.0 \
      --warmup 0.3 --no-replay-floor --json "$OUT/spin.json"
  fi
  {
    echo "# hp bundle B, tree $(tree_commit), $(elapsed)"
    grep -E "staged +[0-9]" "$OUT/wall.log" | tail -24 | cut -c1-230  # the last round's
    grep -A6 "^# variants" "$OUT/wall.log" | cut -c1-200
    cat "$OUT/glp.log"
    grep -E "^replay|step p50" "$OUT/spin.log" 2>/dev/null | tail -8 | cut -c1-200
    steps
  } | table
fi
if [[ $PHASE == c ]]; then  # bundle C (bound 60 s): the new defaults (X_SPLIT_MIN, COPY_KERNEL_MAX
  # 2 MiB) against the old, c4 (no halves by x at all, x by the kernel up to 4 MiB: 3584x18944
  # N=64 whole too) and wc (the new + x's staging write-combined from 256 KiB: B's probe saw a
  # fill slow x's DMA by half), alternated per round, staged and graph (x copied by the backend,
  # as the service's); then the launcher's GPU tests on the new defaults
  BOUND=${BOUND:-60}
  step wall 26 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096,3584x18944 \
    --ns 64,32 --modes staged,graph --calls 200 --rounds 3 --json "$OUT/wall.json" \
    --variants "def;old:X_SPLIT_MIN=1572864,COPY_KERNEL_MAX=1048576;c4:X_SPLIT_MIN=0,COPY_KERNEL_MAX=4194304;wc:STAGING_WC_MIN=262144"
  step tests 20 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    tests/service/test_launch_split.py
  left 8 && step tests_halves "$(bound 14 1)" python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/kernels/test_cuda_backend_host.py -k "halves or copy or chunks"
  {
    echo "# hp bundle C, tree $(tree_commit), $(elapsed)"
    grep -A12 "^# variants" "$OUT/wall.log" | cut -c1-200
    grep -c DIFFERS "$OUT/wall.log" | sed 's/^/rows with y differing: /'
    tail -1 "$OUT/tests.log" 2>/dev/null
    tail -1 "$OUT/tests_halves.log" 2>/dev/null
    steps
  } | table
fi
exit 0
