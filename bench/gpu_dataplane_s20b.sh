#!/usr/bin/env bash
# Session 20, issue 15, bundle B (bound 60 s). 1. More of the NumPy-first data-plane tests on the
# CUDA backend with the backend's tolerance (tests/dataplane/tol.py; bundle A ran test_sys_pipe.py
# and test_lane.py: 11 passed). 2. T2 (64 callers of N=1, bytes, 6 front ends round robin, as the
# closing check runs it) at 8 and 6 front ends alternated (f8 f6), the device process's stages on
# each: whether 8 front ends hold T2's p99 better on the same host (bundle A's host, slow: 15.7k
# rows/s, p99 8.8 ms at 6; its 8 did not fit). 3. One more T3 over CUDA regions with the stages,
# if it fits. No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s20b.sh   env: BOUND (57), NEED (9), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), TESTS (the test files)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp20b
BOUND=${BOUND:-57} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 40; then
  # shellcheck disable=SC2086  # (TESTS: several paths)
  # (-v: each test's verdict as it ends, so a run cut at its limit still says which passed)
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 22 4)" python3 -m pytest -v -rfE \
    -p no:cacheprovider ${TESTS:-tests/dataplane/test_regions.py tests/dataplane/test_device_merge.py \
    tests/dataplane/test_pipeline_short.py tests/dataplane/test_frontends.py} \
    >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_dataplane_cuda.log") failed) at $(elapsed)"
fi
t2() {  # t2 RUN NAME: bench/service.py's T2 (bytes) at $FRONTENDS front ends, with the stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 20 2)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends "${FRONTENDS:-6}" \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T2 --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 bytes, ${FRONTENDS:-6} front ends) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t3() {  # t3 RUN NAME: bench/service.py's T3 over CUDA regions, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 20 2)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions "${REGION:-cuda}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 ${REGION:-cuda}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
ab_runs "${NEED:-9}" t2 "f8:FRONTENDS=8" "f6:FRONTENDS=6"
ab_runs "${NEED:-9}" t3 "c:REGION=cuda"
{
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  python3 bench/t3_ab_table.py "$OUT" 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h "^T2 fe=" "$f" | cut -c1-140)"
  done
} | table
