#!/usr/bin/env bash
# Session 20, issue 15, bundle A: where the device process's loop time goes per call, by stage
# (Q6SERVE_DP_STATS's stage timers: bench/device_stats_table.py --stages), under T3 through CUDA
# and system regions (8 hosts of N=64 on ffn_down, 6 front ends round robin; c s s c) and under
# T2 (64 callers of N=1, bytes: bench/t2_timeline.py, what the slowest 1% wait in); first the
# NumPy-first data-plane tests whose y checks now take the backend's tolerance
# (tests/dataplane/tol.py), on the CUDA backend. No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s20a.sh   env: BOUND (95), NEED (8), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp20a
BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 40; then  # the region, lane and full-system-region paths on the backend under test
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 28 4)" python3 -m pytest -q -rfE \
    -p no:cacheprovider ${TESTS:-tests/dataplane/test_sys_pipe.py tests/dataplane/test_lane.py} \
    >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(tail -1 "$OUT/pytest_dataplane_cuda.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over $REGION regions, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 30 4)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions "${REGION:-cuda}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 ${REGION:-cuda}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
ab_runs "${NEED:-8}" t3 "c:REGION=cuda" "s:REGION=system" "s:REGION=system" "c:REGION=cuda"
if left 22; then  # T2's slowest 1%, with the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_t2.jsonl timeout "$(bound 22 2)" python3 bench/t2_timeline.py \
    --backend "$BACKEND" --rows "${ROWS:-3584}" --k "${K:-18944}" --frontends 6 --hosts 8 \
    --callers 8 --seconds "${T2_SECONDS:-2.0}" --warmup 0.5 --json "$OUT/tl_t2.json" \
    >"$OUT/tl_t2.log" 2>&1
  note "# t2 (t2_timeline 8x8) rc=$? at $(elapsed)"
  archive 2>/dev/null
fi
{
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | head -8
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair c:s:"cuda / system" 2>&1
  [[ -f $OUT/tl_t2.log ]] && tail -25 "$OUT/tl_t2.log"
} | table
