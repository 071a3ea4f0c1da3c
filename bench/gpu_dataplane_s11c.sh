#!/usr/bin/env bash
# Issue 15, session 11 (helper dp): where T2's tail comes from on the H200, and whether freezing
# a front end's start-up objects out of the cyclic GC (Q6SERVE_FRONTEND_GC_FREEZE=1, off by
# default) shortens it. T2 = 8 load processes x 8 callers of N=1 (f16) on ffn_down 3584x18944
# through 4 front ends; bench/t2_timeline.py cuts each call into up / decode / stack / device /
# fanout / encode / writer / down at p50 and over the slowest 1%, with each front end's callers
# and the worker's GC pauses and long loop iterations. One worker per variant, RUNS loads each
# (a full collection comes every few thousand calls of a front end), alternated; the script
# skips what would end past BUDGET_S.
#   bench/gpu_dataplane_s11c.sh   env: SECONDS_PER_RUN (2), RUNS (3), BUDGET_S (60)
#   DRY_RUN=1 BACKEND=numpy ROWS=16 K=256 OUT=/tmp/o bench/gpu_dataplane_s11c.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps11c
S=${SECONDS_PER_RUN:-2} RUNS=${RUNS:-3} BUDGET=${BUDGET_S:-60}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}  # (a CPU rehearsal: numpy, small)
archive() { tar czf "$FINAL/dataplane_s11c.tgz" -C "$OUT" .; }
left() { (($(date +%s) - T0 + $1 < BUDGET)); }  # left SECONDS: still inside the budget
t2() {  # t2 TAG FREEZE
  left $((8 + RUNS * (S + 2))) || { note "# t2 $1 skipped at $(elapsed)"; return; }
  local limit=$((30 + RUNS * (S + 8))) rest=$((BUDGET + T0 - $(date +%s)))
  ((rest < limit)) && limit=$rest  # (never past the budget: a bundle's bound)
  (cd bench && Q6SERVE_FRONTEND_GC_FREEZE=$2 timeout $limit python3 \
    t2_timeline.py --backend "$BACKEND" --rows "$ROWS" --k "$K" --frontends 4 --hosts 8 \
    --callers 8 --seconds "$S" --warmup 0.3 --runs "$RUNS" --json "$OUT/t2_$1.json" \
    --keep "$OUT/keep_$1" >"$OUT/t2_$1.log" 2>&1)
  note "# t2 $1 rc=$? at $(elapsed)"
  grep -E "^run|^\| (p|band)|stalls" "$OUT/t2_$1.log" | cut -c1-400
  archive
}
t2 default 0
t2 freeze 1
archive
