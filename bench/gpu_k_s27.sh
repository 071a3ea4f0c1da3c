#!/usr/bin/env bash
# k's device command, session 27 (issue 16: the N <= 16 cells of the 48-56 MB shapes, and N=64
# on the 11-14 MB weights), bounded by BOUND (s); PHASE picks the bundle's part. Session 26's
# script (the cluster-sum forms of the wgmma tile) is in git history (commit 6fb1383).
# PHASE=a (bound 100):
# 1. wgab: where the ~5 us of fixed cost inside a 20-25 us N = 8/16 call goes, and two changes
#    aimed at it, on the table's own K-slice cells (src 4) of 4096x14336 and 18944x3584 at N = 8
#    and of 4096x14336 at N = 16 (bench/wg_ab.py, alternated twice in one process, bits
#    compared, AUTO beside): --trace now: one call (today's kernel) with per-warp stamps (start
#    spread, activation staging, first tile, per block, span); su8: the activation staging
#    at 1/2 n-tiles with 8 loads in flight per thread instead of 4 (Q6SERVE_STAGE_U_SMALL; an
#    N=8 slice of 7 blocks is 7 items per thread: one L2 round trip instead of two before the
#    first weight math); rp1 / rp2
#    (Q6SERVE_KS_RAMP, q6k_matmul.cu): each warp, right after its first block's register loads,
#    bulk-prefetches its next 1 / 2 blocks into L2, so the opening DRAM burst covers more than
#    one block per warp while the CTA stages its activations (no registers; the same bits);
#    c0: today's text compiled as the variants are (sm_90a: the control for now's sm_90 module);
#    ns: that without the split-K sum launch (y incomplete: the sum's whole cost); xf
#    (Q6SERVE_KS_XFIRST): the first block's register loads after the staging instead of before
#    (the staging's L2 reads then queue behind no DRAM burst); xr1: xf with the first 2 blocks
#    bulk-prefetched into L2 at the start (RAMP 1 from the first block).
# 2. wg2: rp1 / rp2 on the N=1 cells of the f16 tile (src 2; 18944x3584 with its first block
#    early, PF: the next 1 / 2 blocks; 4096x14336 and 3584x18944 without: the CTA's first 1 / 2
#    blocks, before the staging) and c0, AUTO = the cell itself, alternated twice in one process.
# 3. cfgab (ask 3): src 7 (the cluster-sum K-slice tile) nt 8 at N=64 on 3584x3584 (K split 7,
#    4) and 4096x4096 (8, 4), 8 warps with the prefetch and 12 without, against today's AUTO
#    (src 4 + its PDL-launched sum: 17.2 / 17.8 us, 0.72 / 0.83x torch in session 26's check);
#    a K split the shape does not cut into is reported as a failed candidate.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-100}
note "# setup done $(elapsed)"
INC='#include "q6k_matmul.cu"'

ab_report() {
  echo "# $1: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
  grep -E "^# [0-9]+x[0-9]+ N=|^ *[0-9]+x[0-9]+ +[0-9]+ |trace|warps [0-9]+ on" \
    "$OUT/$1.log" 2>/dev/null | sed -E 's/ +/ /g'
}

if [[ ${PHASE:-a} == a ]]; then
  V=(--variant "su8|$INC|#define Q6SERVE_STAGE_U_SMALL 8
$INC" --variant "rp1|$INC|#define Q6SERVE_KS_RAMP 1
$INC" --variant "rp2|$INC|#define Q6SERVE_KS_RAMP 2
$INC" --variant "c0||" --variant "ns||" --variant "xf|$INC|#define Q6SERVE_KS_XFIRST 1
$INC" --variant "xr1|$INC|#define Q6SERVE_KS_XFIRST 1
#define Q6SERVE_KS_RAMP 1
$INC")
  C="4096x14336:8,18944x3584:8,4096x14336:16"
  step wgab 55 python3 bench/wg_ab.py "${V[@]}" --nopost ns --auto --trace now \
    --cells "$C" --rounds 2 --iters 30 --json "$OUT/wgab.json"
  step wg2 22 python3 bench/wg_ab.py "${V[@]:2:6}" --auto --rounds 2 --iters 30 \
    --cells 4096x14336:1,18944x3584:1,3584x18944:1 --json "$OUT/wg2.json"
  A="64:nt=8,src=7,pf=1,warps=8,ksplit=7;64:nt=8,src=7,pf=1,warps=8,ksplit=4"
  A+=";64:nt=8,src=7,pf=1,warps=8,ksplit=8;64:nt=8,src=7,warps=12,ksplit=4"
  step cfgab 20 python3 bench/kernels.py --cfg-ab "$A" --rounds 2 --shapes 3584x3584,4096x4096 \
    --json "$OUT/cfgab.json"
  { echo "== k session 27 PHASE=a (tree $(tree_commit)), $(elapsed)"; steps; ab_report wgab
    echo "# cfgab: shape N AUTO us candidate us AUTO/cand rel torch"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/cfgab.log" 2>/dev/null | sed -E 's/ +/ /g'
    ab_report wg2; } | table
  exit 0
fi
# PHASE=b (bound 100). Bundle A (tree ebfdd53): the first block's register loads after the
# activation staging (xf) ran 4096x14336 N=16 1.056x, N=8 1.030x, 18944x3584 N=8 1.010x, the same
# bits; the L2 ramp prefetch (rp1 / rp2, xr1) lost 3-21%; the sum launch costs 1.9-2.7 us at N =
# 8/16 (ns); src 7 nt8 w8 k4 ran 3584x3584 N=64 1.039x. This tree: Q6SERVE_KS_XFIRST 1 (the
# default now), the table's 3584x3584 N=64 cell on src 7 k4.
# 1. xa: every K-slice launch shape of the table at N <= 16 (its cells on the 48-56 MB shapes,
#    3584x3584, 4096x4096 and an lm-head), now (this tree's product module) against old
#    (XFIRST 0: main's order) and c0 (this text compiled as old is: the control, so old / c0
#    reads the change with the compile held equal), AUTO beside, bench/wg_ab.py alternated twice
#    in one process, bits compared.
# 2. tests: the GPU tests of the K-slice tiles on this tree (test_cuda_ks.py, test_cuda_ksc.py,
#    test_cuda_ks14.py, test_cuda_pairs.py::test_every_table_shape).
# 3. xb: as xa at N = 32/64 (4 and 8 n-tiles: 16 staging loads in flight); and the table's
#    previous 3584x3584 N=64 cell (src 4) beside its new one (AUTO).
if [[ ${PHASE} == b ]]; then
  V=(--variant "old|$INC|#define Q6SERVE_KS_XFIRST 0
$INC" --variant "c0||")
  C="4096x14336:4,4096x14336:8,4096x14336:16,18944x3584:8,18944x3584:16,3584x18944:8"
  C+=",3584x18944:16,14336x4096:1,14336x4096:8,14336x4096:16,3584x3584:8,3584x3584:16"
  C+=",4096x4096:8,4096x4096:16,128256x4096:8"
  step xa 40 python3 bench/wg_ab.py "${V[@]}" --auto --cells "$C" --rounds 2 --iters 30 \
    --json "$OUT/xa.json"
  step tests 30 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_ks.py \
    tests/kernels/test_cuda_ksc.py tests/kernels/test_cuda_ks14.py \
    "tests/kernels/test_cuda_pairs.py::test_every_table_shape"
  C="4096x14336:32,18944x3584:32,3584x18944:32,14336x4096:32,3584x3584:32,3584x3584:64"
  C+=",3584x3584:64:nt8.m1.w8.s4.pf,4096x4096:64"
  step xb 25 python3 bench/wg_ab.py "${V[@]}" --auto --cells "$C" --rounds 2 --iters 30 \
    --json "$OUT/xb.json"
  { echo "== k session 27 PHASE=b (tree $(tree_commit)), $(elapsed)"; steps; ab_report xa
    echo "# tests"; tail -3 "$OUT/tests.log"; ab_report xb; } | table
  exit 0
fi
# PHASE=c (bound 90): bundle B's tests step was cut at its 30 s after 12 passed (test_cuda_ks.py
# 8, test_cuda_ksc.py 3, test_cuda_ks14.py 1): 1. tests: the one it did not reach, every table
# cell's launch shape on pair weights against the reference (the new 3584x3584 N=64 src 7 k4
# cell and the K-slice tiles with XFIRST 1 among them). If time is left (for the next session):
# 2. trace: per-warp stamps of today's kernel (XFIRST 1) on the N=8/16 cells bundle A traced
# (where the staging stands now); 3. clu: the split-K sum inside a cluster (src 7) at the K
# splits of AUTO's N = 8/16 cells of 4096x14336 / 18944x3584 (the sum launch costs 1.9-2.7 us
# there; the plan runs src 4 where the clusters do not all co-reside).
if [[ ${PHASE} == c ]]; then
  step tests 55 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    "tests/kernels/test_cuda_pairs.py::test_every_table_shape"
  step trace 18 python3 bench/wg_ab.py --variant "c0||" --trace now --rounds 1 --iters 10 \
    --cells 4096x14336:8,18944x3584:8,4096x14336:16 --json "$OUT/trace.json"
  A="8:nt=1,src=7,pf=1,warps=8,ksplit=8;8:nt=1,src=7,pf=1,warps=8,ksplit=7"
  A+=";16:nt=2,src=7,pf=1,warps=16,ksplit=8;16:nt=2,src=7,pf=1,warps=8,ksplit=7"
  step clu 15 python3 bench/kernels.py --cfg-ab "$A" --rounds 2 --shapes 4096x14336,18944x3584 \
    --json "$OUT/clu.json"
  { echo "== k session 27 PHASE=c (tree $(tree_commit)), $(elapsed)"; steps
    tail -3 "$OUT/tests.log"; ab_report trace
    echo "# clu: shape N AUTO us candidate us AUTO/cand rel torch"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/clu.log" 2>/dev/null | sed -E 's/ +/ /g'; } | table
  exit 0
fi
# PHASE=d (bound 100; second shift; ran in bundle D on tree b4c3af6, LOST: 0.75-0.96x at N <= 16,
# 0.51-0.67x at N = 32/64, the same bits; docs/KERNELS.md "Session 27, second shift"). The
# switch it sets is not on main: it lives on branch k-s27-wsum (b4c3af6); on main's text its
# #defines do nothing (ws1 / ws1a then run today's tile without the sum: y incomplete).
# It measured the split-K sum without its second launch, at the grain of
# a warp tile (Q6SERVE_KS_WSUM, q6k_matmul.cu; 0 = the product): every warp, its tile's partials
# written, fences them and takes a ticket on a counter per (warp tile, token chunk); the warp
# that takes the last adds the tile's K-slice partials in slice order (q6k_sum_parts' adds: the
# same bits expected) and writes y. No waiting, no co-residency (sessions 24-26's forms needed a
# CTA to add a whole row group alone, or the group's CTAs / a cluster resident together).
# ws1: a warp takes its tiles' tickets at its end (one fence, nothing in flight then; lane i on
# its i-th tile, so the atomics overlap), fences __threadfence (fence.sc.gpu); ws1a: the same
# with fence.acq_rel.gpu (Q6SERVE_KS_WSUM_AR). Both run without the sum launch (--nopost); ns =
# today's tile without it (y incomplete: the sum's whole cost, 1.9-2.7 us at N = 8/16 in bundle
# A); c0 = today's text compiled as the variants are (the control); --recheck 2: two more calls
# each on a fresh x, bits against now (stale counters would show).
# 1. wsa: the src 4 cells at N <= 16 (the 48-56 MB shapes, 4096x4096, an lm-head at N=8: many
#    tiles per warp); 2. wsb: N = 32/64 (src 4; the sum's bytes grow with N); 3. tests: the
#    K-slice GPU tests on this tree (the product's PTX is main's with WSUM 0: nvcc -ptx equal).
if [[ ${PHASE} == d ]]; then
  V=(--variant "c0||" --variant "ns||" --variant "ws1|$INC|#define Q6SERVE_KS_WSUM 1
$INC" --variant "ws1a|$INC|#define Q6SERVE_KS_WSUM 1
#define Q6SERVE_KS_WSUM_AR 1
$INC")
  C="4096x14336:16,4096x14336:8,18944x3584:8,3584x18944:16,18944x3584:16,3584x18944:8"
  C+=",4096x4096:16,4096x4096:8,128256x4096:8,4096x14336:4"
  step wsa 55 python3 bench/wg_ab.py "${V[@]}" --nopost ns,ws1,ws1a --auto --recheck 2 \
    --cells "$C" --rounds 2 --iters 30 --json "$OUT/wsa.json"
  C="4096x14336:32,18944x3584:32,3584x18944:32,14336x4096:32,4096x4096:64,14336x4096:64"
  step wsb 27 python3 bench/wg_ab.py "${V[@]}" --nopost ns,ws1,ws1a --auto --recheck 2 \
    --cells "$C" --rounds 2 --iters 30 --json "$OUT/wsb.json"
  step tests 12 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_ks.py
  { echo "== k session 27 PHASE=d (tree $(tree_commit)), $(elapsed)"; steps; ab_report wsa
    ab_report wsb; echo "# tests"; tail -3 "$OUT/tests.log"; } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
