#!/usr/bin/env bash
# Session 21, issue 15, bundle A. 1. The GPU tests of the pipelined CUDA-region calls and of the
# place graphs (Q6SERVE_DP_PLACE_GRAPH: a repeated CUDA-region call as ONE graph launch per
# (weight, N, x and y place, slot), x's and y's copies and the slot's completion event inside;
# y bit for bit against the bytes path, a reloaded weight at the same places). 2. T3 over CUDA
# regions (8 hosts of N=64 on ffn_down, 6 front ends round robin) with place graphs on / off
# alternated (p1 p0 p0 p1 p1 p0), the device process's stages on each (session 20: the launch's
# three CUDA runtime calls were ~37 us of its ~175 a call). 3. tests/dataplane/test_frontends.py
# on the CUDA backend (the backend's tolerance, tests/dataplane/tol.py; not reached in session
# 20), with what is left of the bound. No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s21a.sh   env: BOUND (95), NEED (10), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), TESTS (the test files)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp21a
BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 50; then  # the pipelined CUDA-region calls and the place graphs, y bit for bit
  timeout "$(bound 25 4)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider \
    tests/dataplane/test_cuda_ipc_gpu.py -k "behind_each_other or place_graphs" \
    >"$OUT/pytest_place.log" 2>&1
  note "# place-graph gpu tests rc=$? ($(tail -1 "$OUT/pytest_place.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over CUDA regions, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 25 4)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions cuda \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 cuda, place graphs ${Q6SERVE_DP_PLACE_GRAPH:-1}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
P0=Q6SERVE_DP_PLACE_GRAPH=0 P1=Q6SERVE_DP_PLACE_GRAPH=1
ab_runs "${NEED:-10}" t3 "p1:$P1" "p0:$P0" "p0:$P0" "p1:$P1" "p1:$P1" "p0:$P0"
if left 8; then  # (-v: each test's verdict as it ends, so a run cut at its limit says which passed)
  # shellcheck disable=SC2086  # (TESTS: several paths)
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 40 2)" python3 -m pytest -v -rfE \
    -p no:cacheprovider ${TESTS:-tests/dataplane/test_frontends.py} \
    >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_dataplane_cuda.log") failed) at $(elapsed)"
fi
{
  echo "# place-graph gpu tests: $(tail -1 "$OUT/pytest_place.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_place.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair p0:p1:"cuda, place graphs 0 / 1" 2>&1
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | cut -c1-120)"
  grep -E " (FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# $(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null) passed on $BACKEND"
} | table
