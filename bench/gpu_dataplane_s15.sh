#!/usr/bin/env bash
# Issue 15, session 15 (helper dp): T2 with the device process's batch wait a loop trip after its
# launch (Q6SERVE_DEVICE_PIPELINE=1) against the inline wait (the default), alternated. T2 = 8
# load processes x 8 callers of N=1 (f16) on ffn_down 3584x18944; each variant is one worker and
# one load of bench/t2_timeline.py (the call-by-call parts at p50 and over the slowest 1%, each
# worker process's cores and loop-busy share, the load's and the machine's cores). Session 14:
# at 6 front ends the device process's loop is 0.84-0.89 busy, of it the synchronous wait for
# each inline batch's GPU job. The script skips what would end past BUDGET_S and prints a table
# last. STATS=1: one more run of the last variant with Q6SERVE_DP_STATS (the device process's
# counters, pipelined waits included; not in the A/B: the counters cost loop time). LANE=1: first
# the lane's figures of this session: one caller N=1 through the fast lane with its stamped parts
# (bench/lane_latency.py --stamps; the stretch: p50 - kernel <= 50 us) and T3 through lanes
# (8 hosts x 4 callers of N=64, bench/frontend_cpu.py --lane; >= 0.5 of the kernel alone).
#   bench/gpu_dataplane_s15.sh   env: SECONDS_PER_RUN (2), BUDGET_S (100), VARIANTS (below),
#                                STATS (0), LANE (0), WITH4 (0), CLOSE (0: see below)
#   DRY_RUN=1 BACKEND=numpy ROWS=16 K=256 OUT=/tmp/o bench/gpu_dataplane_s15.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-100}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}
RR=Q6SERVE_FRONTEND_ROUND_ROBIN=1 PIPE=Q6SERVE_DEVICE_PIPELINE=1
# TAG:FRONTENDS[:ENV=VALUE,...]
VARIANTS=${VARIANTS:-"off6a:6:$RR pipe6a:6:$RR,$PIPE pipe6b:6:$RR,$PIPE off6b:6:$RR \
off6c:6:$RR pipe6c:6:$RR,$PIPE"}
[[ ${WITH4:-0} != 0 ]] && VARIANTS="$VARIANTS pipe4a:4:$PIPE off4a:4"  # (4 front ends, hash)
if [[ ${CLOSE:-0} != 0 ]]; then  # the closing check's add-on: def (the worker's default) vs =0
  OFF=Q6SERVE_DEVICE_PIPELINE=0
  VARIANTS="def6a:6:$RR off6a:6:$RR,$OFF off6b:6:$RR,$OFF def6b:6:$RR"
fi
archive() {  # (fast: after each run; the per-call .npy arrays stay behind: 5 MB a run)
  tar -I "gzip -1" --exclude="*.npy" -cf "$FINAL/dataplane_s15.tgz" -C "$OUT" .
}
left() { (($(date +%s) - T0 + $1 < BUDGET)); }  # left SECONDS: still inside the budget
t2() {  # t2 TAG FRONTENDS ENVS [SECONDS [MORE ARGS]]
  local s=${4:-$S}
  left $((9 + s)) || { note "# t2 $1 skipped at $(elapsed)"; return; }
  local limit=$((25 + s)) rest=$((BUDGET + T0 - $(date +%s)))
  ((rest < limit)) && limit=$rest  # (never past the budget: a bundle's bound)
  local envs=()
  [[ -n $3 ]] && IFS=, read -ra envs <<<"$3"
  (cd bench && env "${envs[@]}" timeout "$limit" python3 t2_timeline.py --backend "$BACKEND" \
    --rows "$ROWS" --k "$K" --frontends "$2" --hosts 8 --callers 8 --seconds "$s" \
    --warmup 0.3 --runs 1 --json "$OUT/t2_$1.json" --keep "$OUT/keep_$1" "${@:5}" \
    >"$OUT/t2_$1.log" 2>&1)
  note "# t2 $1 (F=$2 ${3:-defaults}) rc=$? at $(elapsed)"
  grep -E "^run|^\| (p|band)|^per front|^cores|^load" "$OUT/t2_$1.log" | cut -c1-400
  archive
}
if [[ ${LANE:-0} != 0 ]]; then  # this session's lane figures first: the stretch and T3
  # the stretch: one caller, N=1, through the fast lane (p50 - kernel <= 50 us), stamped parts
  (cd bench && timeout 45 python3 lane_latency.py --backend "$BACKEND" --rows "$ROWS" --k "$K" \
    --paths lane --stamps --seconds "$S" --json "$OUT/lane_n1.json" >"$OUT/lane_n1.log" 2>&1)
  note "# lane N=1 rc=$? at $(elapsed)"
  grep -v "^#" "$OUT/lane_n1.log" | tail -12 | cut -c1-300
  # T3 through lanes: 8 hosts x 4 callers of N=64, x and y in page-locked system regions
  timeout 45 python3 bench/frontend_cpu.py --backend "$BACKEND" --rows "$ROWS" --k "$K" --n 64 \
    --lane --frontends 1 --hosts 8 --callers 4 --seconds "$S" --warmup 0.5 \
    --json "$OUT/lane_t3.json" >"$OUT/lane_t3.log" 2>&1
  note "# T3 lanes rc=$? at $(elapsed): $(tail -1 "$OUT/lane_t3.log" | cut -c1-300)"
  grep -iE "rows/s|kernel|fraction" "$OUT/lane_t3.log" | tail -4 | cut -c1-300
  archive
fi
read -ra V <<<"$VARIANTS"
for v in "${V[@]}"; do
  IFS=: read -r tag fe envs <<<"$v"
  t2 "$tag" "$fe" "${envs:-}"
done
if [[ ${STATS:-0} != 0 ]]; then
  IFS=: read -r tag fe envs <<<"${V[-1]}"
  t2 "stats_$tag" "$fe" "${envs:+$envs,}Q6SERVE_DP_STATS=$OUT/dpstats_$tag.jsonl"
  tail -1 "$OUT/dpstats_$tag.jsonl" 2>/dev/null | python3 -c '
import json, sys
d = json.loads(sys.stdin.read() or "{}")
keys = ("msg_mm", "mm_rows", "batches", "batch_rows", "direct_jobs", "pipelined_batches",
        "pipelined_wait_s", "inline_jobs_wall_s", "select_s", "loop_iterations", "t")
print("# device process counters (cumulative):", {k: d.get(k) for k in keys})'
fi
python3 bench/t2_table.py "$OUT"
