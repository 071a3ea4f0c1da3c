#!/usr/bin/env bash
# Session 18, issue 15, bundle A: what bounds T3 through CUDA regions (0.46 of the kernel alone at
# session 17's closing check) and through system regions (0.20), and two changes of the device
# process, each A/B'd by a switch of this tree.
# 1. `pytest -m gpu tests/dataplane` (both changes on: the tree's default).
# 2. One T3 run over CUDA regions (8 hosts of N=64, 6 front ends round robin) with the device
#    process's counters (Q6SERVE_DP_STATS: loop busy, CPU, messages) and `py-spy record` on it
#    (where its loop's time goes per call), then the same over system regions.
# 3. Alternated: T3 over CUDA regions with Q6SERVE_DP_LEAN=0 (session 17's path: a CuPy view of x
#    and y per call, the dispatch looked up twice, y through the backend's view) / 1 (views cached
#    per place, the choice kept per cost key, y copied from the workspace's address); T3 over
#    system regions with Q6SERVE_DP_SYS_PIPE=0 (a full call queued to the batcher, waited for
#    inline) / 1 (launched at the trip's end through Engine.launch_now behind the launches out,
#    repeats by their region's plan: the lane's full-batch route).
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s18a.sh   env: BOUND (95), NEED (8), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp18a
BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
SPY=/tmp/site/bin/py-spy
[[ -x $SPY ]] || SPY=$(command -v py-spy || true)
if left 50; then
  timeout "$(bound 40 4)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over $REGION regions (cuda unless set)
  timeout "$(bound 30 4)" python3 bench/service.py --backend "$BACKEND" --dataplane \
    --modes stream --frontends 6 --t3-hosts 8 --seconds "${SECONDS_PER_RUN:-1.5}" \
    --warmup 0.3 --targets T3 --regions "${REGION:-cuda}" --row-scale "${ROW_SCALE:-1.0}" \
    --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (service.py T3 ${REGION:-cuda}, lean ${Q6SERVE_DP_LEAN:-1}, sys pipe ${Q6SERVE_DP_SYS_PIPE:-1}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
prof() {  # prof RUN NAME: t3 with the device process's counters and py-spy on it
  local pid spy=""
  export Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl
  t3 "$1" "$2" &
  local bench=$!
  pid=$(worker_pid 60)
  if [[ -n $pid && -n $SPY ]]; then
    "$SPY" record -p "$pid" --nonblocking -r 400 -f raw -t -o "$OUT/spy_$1.raw" \
      -d "${SPY_SECONDS:-12}" >"$OUT/spy_$1.log" 2>&1 &
    spy=$!
  fi
  wait "$bench"
  [[ -n $spy ]] && { kill -INT "$spy" 2>/dev/null; wait "$spy"; }
  unset Q6SERVE_DP_STATS
  [[ -f $OUT/spy_$1.raw ]] && timeout 20 python3 bench/spy_summary.py "$OUT/spy_$1.raw" \
    --thread MainThread --top 45 >"$OUT/spy_$1.txt" 2>&1
  [[ -f $OUT/spy_$1.raw ]] && timeout 20 python3 bench/spy_summary.py "$OUT/spy_$1.raw" \
    --thread MainThread --under _flush_calls --depth 3 --top 40 >"$OUT/spy_$1_flush.txt" 2>&1
  note "# $1 profiled (worker pid ${pid:-none}, py-spy ${SPY:-none})"
  archive 2>/dev/null
}
ab_runs "${NEED:-8}" prof "pcuda:REGION=cuda" "psys:REGION=system"
C0=REGION=cuda,Q6SERVE_DP_LEAN=0 S0=REGION=system,Q6SERVE_DP_SYS_PIPE=0
ab_runs "${NEED:-8}" t3 "coff:$C0" "con:REGION=cuda" "soff:$S0" "son:REGION=system" \
  "con:REGION=cuda" "coff:$C0" "son:REGION=system" "soff:$S0" "coff:$C0" "con:REGION=cuda"
{
  echo "# device process under T3 (Q6SERVE_DP_STATS, the timed second): calls, loop busy, CPU us a call"
  python3 bench/device_stats_table.py "$OUT" 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair coff:con:"cuda, lean 0 / 1" --pair soff:son:"system, pipe 0 / 1"
} | table
