#!/usr/bin/env bash
# k's device command, session 26 (issue 16: the split-K sum through a thread-block cluster on the
# wgmma tile), bounded by BOUND (s); PHASE picks the bundle's part. Session 25's script (its
# phases a-d: src 8's cells, the spread sum, the K splits) is in git history (commit a6273a8).
# PHASE=a (bound 95): bench/ab/q6k_wgmma_cl.cu, src 8 (q6k_wg_f16) with its K slices of one row
# group as one cluster (__cluster_dims__(1, WG_KC, 1)): each CTA's scaled accumulators go to its
# own shared memory after the activation slice, cluster barrier, CTA r adds the r-th 1/KC of the
# outputs from every rank's shared memory in slice order (q6k_sum_parts' adds: the same bits),
# writes y; no partials in global memory, no sum launch. Session 25 measured src 8's sum at
# 3.7-8.0 us of an N=64 call (ns: the tile without it). bench/wg_ab.py, c5 / c4 / c6 (clusters of
# 5 / 4 / 6, run only on cells with that K split) and ns (today's tile without the sum: its whole cost,
# y incomplete) against now (today's src 8 + q6k_sum_parts), AUTO beside, alternated twice in
# one process, bits compared, 2 more calls on fresh x; the line "# shape N=.. cK: .. at once M"
# says how many clusters co-reside (cuOccupancyMaxActiveClusters) against the grid's.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-95}
note "# setup done $(elapsed)"
CL=bench/ab/q6k_wgmma_cl.cu
L8=nt8.m1.w8.s8.pf
L12=nt8.m1.w12.s8.pf

cluster_report() {
  echo "== k session 26 PHASE=${PHASE:-a} (tree $(tree_commit)), $(elapsed)"
  steps
  echo "# $1: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
  grep -E "^# [0-9]+x[0-9]+ N=|^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/$1.log" 2>/dev/null |
    sed -E 's/ +/ /g'
}

if [[ ${PHASE:-a} == a ]]; then
  V=(--variant "c5|||$CL|4096" --variant "c4|#define WG_KC 5|#define WG_KC 4|$CL|4096"
     --variant "c6|#define WG_KC 5|#define WG_KC 6|$CL|4096" --variant "ns||")
  C="3584x3584:64:$L12.k5,3584x3584:64:$L8.k4,4096x4096:64:$L12.k4,4096x4096:64:$L8.k4"
  C+=",4096x4096:64:$L12.k6"
  C+=",14336x4096:64,18944x3584:64,18944x3584:64:$L12.k4"
  step cluster 62 python3 bench/wg_ab.py "${V[@]}" --nopost c5,c4,c6,ns --auto --cells "$C" \
    --rounds 2 --iters 30 --recheck 2 --json "$OUT/cluster.json"
  cluster_report cluster | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
