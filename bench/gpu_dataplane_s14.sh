#!/usr/bin/env bash
# Issue 15, session 14 (helper dp): T2's p99 by front-end count. T2 = 8 load processes x 8
# callers of N=1 (f16) on ffn_down 3584x18944; each variant is one worker and one load of
# bench/t2_timeline.py (the call-by-call parts at p50 and over the slowest 1%, each worker
# process's cores and loop-busy share, the load's and the machine's cores). At 4 front ends
# (session 14's first check) each front end's loop is 0.91-0.94 busy and the slowest 1% wait
# ~5 ms in `up` (a request that arrives during a long loop iteration); 5 and 6 front ends
# spread the same calls over more loops (8 made the device process's loop the bound in
# session 13). Alternated; the script skips what would end past BUDGET_S and prints a table
# last. Last, if the budget allows: one more 4-front-end run with py-spy (--native) on one
# front end through the timed part (where its loop's time goes), not in the A/B.
#   bench/gpu_dataplane_s14.sh   env: SECONDS_PER_RUN (2), BUDGET_S (95), VARIANTS (below),
#                                SPY (1; 0: no profile run)
#   DRY_RUN=1 BACKEND=numpy ROWS=16 K=256 OUT=/tmp/o bench/gpu_dataplane_s14.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-95}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}
# TAG:FRONTENDS[:ENV=VALUE,...]  (rr = Q6SERVE_FRONTEND_ROUND_ROBIN=1)
VARIANTS=${VARIANTS:-"f4a:4 f6a:6 f5a:5 f6rra:6:Q6SERVE_FRONTEND_ROUND_ROBIN=1 f4b:4 f6b:6 f5b:5 \
f6rrb:6:Q6SERVE_FRONTEND_ROUND_ROBIN=1"}
archive() {  # (fast: after each run; the per-call .npy arrays stay behind: 5 MB a run)
  tar -I "gzip -1" --exclude="*.npy" -cf "$FINAL/dataplane_s14.tgz" -C "$OUT" .
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
  grep -E "^run|^\| (p|band)|^per front|^cores|^load|^# (py-spy|no profile)" "$OUT/t2_$1.log" \
    | cut -c1-400
  archive
}
read -ra V <<<"$VARIANTS"
[[ -n ${SKIP_T2:-} ]] || for v in "${V[@]}"; do
  IFS=: read -r tag fe envs <<<"$v"
  t2 "$tag" "$fe" "${envs:-}"
done
if [[ ${SPY:-1} != 0 ]]; then
  t2 spy4 4 "" 3 --spy "$OUT/spy4.raw"
  if [[ -s $OUT/spy4.raw ]]; then
    echo "## py-spy --native, one front end's loop thread (MainThread), 200 Hz x 2 s"
    python3 bench/spy_summary.py "$OUT/spy4.raw" --thread MainThread --top 30 | cut -c1-160
    python3 bench/spy_summary.py "$OUT/spy4.raw" --top 1 | sed -n '2,12p' | cut -c1-120
  else
    tail -3 "$OUT/spy4.raw.log" 2>/dev/null
  fi
  archive
fi
python3 bench/t2_table.py "$OUT"
