#!/usr/bin/env bash
# Session 19, issue 15, bundle B: ready polling (Q6SERVE_DP_READY_POLL) decided. T3 (8 hosts of N=64
# on ffn_down, 6 front ends round robin) with the device process's counters on every run
# (Q6SERVE_DP_STATS: its loop's busy share, its seconds in the launches' waits), alternated:
# - system regions, sp0 / s1: Q6SERVE_DP_READY_POLL=0 (the launches out waited for by a blocking
#   sync: session 18's bundle A, 43 us a system-region call) / 1 (answered once their slot's event
#   is done, the loop reading messages meanwhile);
# - CUDA regions, c0 / c1: the same (15 us a call blocked; bundle A of session 19: 4 pairs with
#   session 18's, even).
# First the GPU test of the pipelined CUDA-region calls (ready polling on). No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s19b.sh   env: BOUND (57), NEED (8), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp19b
BOUND=${BOUND:-57} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 40; then  # the pipelined CUDA-region calls with ready polling on (this tree's default)
  timeout "$(bound 15 4)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_cuda_ipc_gpu.py -k behind_each_other >"$OUT/pytest_dataplane_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over $REGION regions, the device process's counters
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 30 4)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends "${FRONTENDS:-6}" --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions "${REGION:-cuda}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 ${REGION:-cuda}, ready poll ${Q6SERVE_DP_READY_POLL:-1}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
S0=REGION=system,Q6SERVE_DP_READY_POLL=0 S1=REGION=system
C0=REGION=cuda,Q6SERVE_DP_READY_POLL=0 C1=REGION=cuda
ab_runs "${NEED:-8}" t3 "sp0:$S0" "s1:$S1" "s1:$S1" "sp0:$S0" "c0:$C0" "c1:$C1"
{
  echo "# device process under T3 (Q6SERVE_DP_STATS, the busiest second): calls, loop busy, CPU us a call, its waits"
  python3 bench/device_stats_table.py "$OUT" 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair sp0:s1:"system, ready poll 0 / 1" \
    --pair c0:c1:"cuda, ready poll 0 / 1"
} | table
