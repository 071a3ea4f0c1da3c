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
# Then the product form's GPU tests (src 10, q6k_wgc_f16 in kernels/cuda/q6k_wgmma.cu, only on
# branch k-s26-wgc, where bundle A ran this phase: tree 50b2305; on main the step finds no
# tests/kernels/test_cuda_wgc.py and src 10 is no launch shape, so run PHASE=a from that branch):
# tests/kernels/test_cuda_wgc.py (src 8's bits at the split, reference, AoS twin).
# Then bench/kernels.py --cfg-ab on the 11-14 MB weights at N=64 (AUTO src 4, 0.71 / 0.82x of
# torch): src 10 through the product's plan (a grid whose clusters do not all co-reside runs src
# 8), and item 2's plan with more row groups and no / less K split: the 32-token wgmma tile (nt
# 4: a 14-block K slice's activations, 224 KB, fit one CTA) in two token chunks at K split 1-2.
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
  step cluster 45 python3 bench/wg_ab.py "${V[@]}" --nopost c5,c4,c6,ns --auto --cells "$C" \
    --rounds 2 --iters 30 --recheck 2 --json "$OUT/cluster.json"
  WGC=tests/kernels/test_cuda_wgc.py  # (branch k-s26-wgc only)
  [[ -f $WGC ]] && step tests 30 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "$WGC"
  W4="nt=4,src=8,pf=1"
  A="64:$W4,warps=4,ksplit=1;64:$W4,warps=8,ksplit=1;64:$W4,warps=4,ksplit=2"
  A+=";64:$W4,warps=8,ksplit=2;64:nt=8,src=10,pf=1,warps=12,ksplit=4"
  A+=";64:nt=8,src=10,pf=1,warps=8,ksplit=4;64:nt=8,src=10,pf=1,warps=12,ksplit=5"
  A+=";64:nt=8,src=10,pf=1,warps=12,ksplit=6"
  step cfgab 30 python3 bench/kernels.py --cfg-ab "$A" --rounds 2 --shapes 3584x3584,4096x4096 \
    --json "$OUT/cfgab.json"
  { cluster_report cluster; echo "# tests"; tail -3 "$OUT/tests.log"
    echo "# cfgab: shape N AUTO us candidate us AUTO/cand rel torch"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/cfgab.log" 2>/dev/null | sed -E 's/ +/ /g'; } | table
  exit 0
fi
# PHASE=b (bound 95): bundle A's pull form paid 1.6-2.2 us for its sum (c - ns) where one
# round's clusters co-reside and lost at 4 rounds (14336x4096, 0.973x: two cluster barriers and
# remote loads per round stall the weight stream). bench/ab/q6k_wgmma_cp.cu pushes instead:
# each warp's partials stored into the owner CTA's shared memory (st.shared::cluster), one
# barrier per round split into arrive (after the pushes) and wait (after the next round's
# tile), two buffers, owners add from their own shared memory (the same bits). p2..p5 (clusters
# of 2..5) and c5 (bundle A's pull form) against now (src 8 + q6k_sum_parts) and ns (no sum),
# AUTO beside, on 3584x3584 N=64 k5, 14336x4096 N=64 (4 rounds), 18944x3584 N=64 k5 and the
# lm-heads (their sums move 39-117 MB of partials: 152064x3584 N=64 k3 at w8, N=32 k2;
# 128256x4096 N=64 k4, N=32 k2); a grid whose clusters do not all co-reside is narrowed to
# those that do (wg_ab.py; "runs grid" in the log).
if [[ ${PHASE} == b ]]; then
  P=bench/ab/q6k_wgmma_cp.cu
  V=(--variant "p5|||$P|8200" --variant "c5|||$CL|4096" --variant "ns||")
  for kc in 2 3 4; do V+=(--variant "p$kc|#define WG_KC 5|#define WG_KC $kc|$P|8200"); done
  C="3584x3584:64:$L12.k5,14336x4096:64,18944x3584:64,152064x3584:64:$L8.k3,152064x3584:32"
  C+=",128256x4096:64,128256x4096:32"
  step push 70 python3 bench/wg_ab.py "${V[@]}" --nopost p2,p3,p4,p5,c5,ns --auto --cells "$C" \
    --rounds 2 --iters 30 --recheck 2 --json "$OUT/push.json"
  cluster_report push | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
