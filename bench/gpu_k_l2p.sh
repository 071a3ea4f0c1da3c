#!/usr/bin/env bash
# Session 10 (issue 16, helper k), device call 1: the K-slice tile with each warp tile's K slice
# bulk-prefetched into L2 (mma_f16 src 8, q6k_ks_f16's L2P). One call: its GPU tests (reference,
# slice counts, slabs, AoS twin, src 4's bits), then bench/tile_probe.py --l2p: src 4's launch
# shapes and their src 8 twins beside AUTO on the 48-56 MB shapes and one lm-head, N = 1..32,
# same process (the A/B), the side-by-side table last.
set -uo pipefail
export OUT=${OUT:-$PWD/out}
KSTEST_ARGS="-k l2_prefetch" KSTEST_TIMEOUT=${KSTEST_TIMEOUT:-150} bench/gpu_run.sh kstest
rc=$?
SKIP_INSTALL=1 TILE_TIMEOUT=${TILE_TIMEOUT:-170} TILE_ARGS="--l2p --no-torch \
  --shapes ${L2P_SHAPES:-4096x14336,3584x18944,14336x4096,18944x3584,152064x3584} \
  --ns ${L2P_NS:-1,2,4,8,16,32}" bench/gpu_run.sh tile
exit $rc
