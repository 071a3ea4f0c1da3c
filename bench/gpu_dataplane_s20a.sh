#!/usr/bin/env bash
# Session 20, issue 15, bundle A. 1. The NumPy-first data-plane tests whose y checks now take the
# backend's tolerance (tests/dataplane/tol.py) on the CUDA backend. 2. Where the device process's
# loop time goes a call, by stage (Q6SERVE_DP_STATS's stage timers: bench/device_stats_table.py
# --stages), under T3 through CUDA and system regions (8 hosts of N=64 on ffn_down, 6 front ends
# round robin); over CUDA regions alternated with the front ends busy polling
# (Q6SERVE_FRONTEND_BUSY_POLL_US=500, c cb cb c: off by default since T2 did not gain; T3's front
# ends wait for the device process's answer with little else to do, a wake-up from epoll each).
# 3. T2 (64 callers of N=1, bytes, as the closing check runs it) at 6 and 8 front ends, the
# device process's stages on each: what its p99 follows on this host. No run starts past
# BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s20a.sh   env: BOUND (95), NEED (8), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), TESTS (the test files)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp20a
BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 50; then  # the pipelined CUDA-region calls, ready polling's event now the taken slot's
  timeout "$(bound 15 4)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_cuda_ipc_gpu.py -k behind_each_other >"$OUT/pytest_ready_poll.log" 2>&1
  note "# ready-poll gpu test rc=$? ($(tail -1 "$OUT/pytest_ready_poll.log")) at $(elapsed)"
fi
if left 40; then  # the region, lane and full-system-region paths on the backend under test
  # shellcheck disable=SC2086  # (TESTS: several paths)
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 26 4)" python3 -m pytest -q -rfE \
    -p no:cacheprovider ${TESTS:-tests/dataplane/test_sys_pipe.py tests/dataplane/test_lane.py} \
    >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(tail -1 "$OUT/pytest_dataplane_cuda.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over $REGION regions, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 30 4)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions "${REGION:-cuda}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 ${REGION:-cuda}, fe busy poll ${Q6SERVE_FRONTEND_BUSY_POLL_US:-0}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t2() {  # t2 RUN NAME: bench/service.py's T2 (bytes) at $FRONTENDS front ends, with the stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 30 4)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends "${FRONTENDS:-6}" \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T2 --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 bytes, ${FRONTENDS:-6} front ends) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
CB=REGION=cuda,Q6SERVE_FRONTEND_BUSY_POLL_US=500
ab_runs "${NEED:-8}" t3 "c:REGION=cuda" "cb:$CB" "cb:$CB" "c:REGION=cuda" "s:REGION=system"
ab_runs "${NEED:-8}" t2 "f6:FRONTENDS=6" "f8:FRONTENDS=8"
{
  echo "# ready-poll gpu test: $(tail -1 "$OUT/pytest_ready_poll.log" 2>/dev/null)"
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | cut -c1-160 | head -8
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair c:cb:"cuda, fe busy poll 0 / 500" 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h "^T2 fe=" "$f" | cut -c1-140)"
  done
} | table
