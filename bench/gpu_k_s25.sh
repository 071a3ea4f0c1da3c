#!/usr/bin/env bash
# k's device command, session 25 (issue 16: the N=64 cells of the two-slab weights), bounded by
# BOUND (s); PHASE picks the bundle's part.
# PHASE=a (bound 75), on branch k-s25-src8rows: the table gives 14336x4096 and 18944x3584 at
# N = 33..64 to the wgmma tile (src 8 nt8 w12 at K split 6 / 5; session 24's bundle B: its kernel
# 39.8 / 41.4 us against the K-slice tile's 41.4 / 46.3), and their large y goes down by the
# weight's two slab row chunks on src 8 (launch.Y_CHUNK_SRCS), where the rule by y's size
# (X_SPLIT_Y_MIN) sent the K-slice tile to token halves x row chunks (4 parts; X_SPLIT_Y_SRCS).
# 1. wall: bench/table_wall.py, staged calls (x built in the staging buffer), old (main's cells:
#    src 4, 4 parts at N=64) / new (src 8, 2 row chunks) / whole (src 8 unsplit) / s8h (src 8 in
#    token halves x rows: the table change alone) / r4 (src 8 in 4 row chunks of a copy of the
#    weight in 4 slabs: y down after a quarter, as the 4 parts; a storage change to weigh next),
#    alternated a b c d e e d c b a in one process, at N = 64 and 48; wall, kernel, host, the
#    GPU's span (pre / tail around the kernels), when the y copy stream's copies are done; y old
#    vs new (other roundings), src 8's splits bit-equal.
# 2. tests: the GPU tests of the change: src 8's row chunks bit-identical to the whole call on both
#    weights (N = 64 / 48, every kind of call, f32 / bf16 y), the K-slice tile's token halves on
#    them as before (the old cells forced), every table cell's launch shape against the reference.
# 3. table_ab: bench/kernels.py --table-ab (kernels alone, old / new alternated twice): the two
#    cells' kernel (the loaded service's calls run whole: Y_CHUNKS_IDLE).
# PHASE=b (bound 75; ran in bundle B on branch k-s25, tree 6117101, whose q6k_matmul.cu has the
# experiment: main's has not, so sp here is main's kernel; lost: docs/KERNELS.md "Session 25"):
# the split-K sum spread over each row group's K-slice CTAs
# (Q6SERVE_KS_SPREAD, q6k_matmul.cu; off in the product): every K-slice / wgmma cell with a K
# split ends in q6k_sum_parts, 2.0-4.3 us a call (session 24's bundle B: today's tile without it);
# session 24's fused sum (the last CTA of a group adds it all) lost 5-26%. Here each CTA, its
# partials written, counts itself in, waits (bounded) for its group's other slices and claims
# 1/ks shares of the group's outputs, adding each in slice order (the same bits); no sum launch.
# 1. spread: bench/wg_ab.py, sp (that) and ns (today's tile without the sum: its whole cost, y
#    incomplete) against now (today's kernel and sum), AUTO beside, alternated twice in one
#    process, bits compared (sp: the same expected; and on 3 more calls each on a fresh x: the
#    counters reset between launches), on the N=16 cells of the 48-56 MB weights
#    (target 2.5 TB/s) and the N=64 cells slower than torch (3584x3584, 4096x4096, 14336x4096,
#    18944x3584) and 4096x14336 N=64 (src 8, K split 12); and src 8 on the N=64 cells the table
#    gives the K-slice tile (3584x3584 k5, 4096x4096 k6, 14336x4096 k6: its sum is a plain
#    launch there, so it may gain more; auto/sp reads it against the table's cell).
# PHASE=c (bound 60): bundle B's ns read the split-K sum's whole cost at 1.9-3.2 us on the N=16
# cells and 4.2-8.0 us on src 8's N=64 cells (18944x3584 k5: 42.3 -> 34.3 us without it): the
# sum's bytes (ks x N x rows x 4, written and re-read) grow with the K split. The K splits of
# src 8 at N=64 (table: 18944x3584 k5, 4096x14336 k12, 3584x18944 k13; 14336x4096 is src 4)
# and of src 4 / 7 at N=16 were set by sweeps before src 8's activations were copied first
# (session 24); bench/kernels.py --cfg-ab re-reads them: AUTO against each candidate,
# alternated twice in one process, y against AUTO's (rel), no torch.
# PHASE=d (bound 60), on branch k-s25-k4: the table gives 14336x4096 N = 33..64 to src 8 nt8 w8
# at K split 4 (bundle C: 38.1 us against src 4's 41.4), its y by the two slab row chunks (28
# CTAs x 4 slices, 2 rounds each). 1. wall: bench/table_wall.py old (src 4, 4 parts at N=64) /
# new, alternated a b b a twice, N = 64 and 48 (bundle A: src 8 w12 k6 in 2 chunks lost 0.979
# at N=64); 2. table_ab: the kernel, old / new; 3. tests: src 8's row chunks bit-identical to the
# whole call on the GPU, every table cell against the reference.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-75}
note "# setup done $(elapsed)"
OLD=14336x4096:64:nt8.m1.w8.s4.pf,18944x3584:64:nt4.m1.w12.s4.pf
# PHASE a and d's summary: the staged host wall of old / new table cells, then the kernels'
wall_report() {
  echo "== k session 25 PHASE=${PHASE:-a} (tree $(tree_commit)), $(elapsed)"
  steps
  echo "# wall: shape N variant pick wall kernel host span pre tail y1 | split, y"
  grep -E "^ *[0-9]+x[0-9]+ |^# per" "$OUT/wall.log" 2>/dev/null | sed -E 's/ +/ /g'
  echo "# table_ab: shape N column old pick us new pick us TB/s old/new"
  grep -E "^[0-9]+x[0-9]+ " "$OUT/table_ab.log" 2>/dev/null | sed -E 's/ +/ /g'
}

if [[ ${PHASE:-a} == a ]]; then
  step wall 30 python3 bench/table_wall.py --shapes 14336x4096,18944x3584 --ns 64,48 \
    --old "$OLD" --variant "whole:new:Y_CHUNKS=0,X_SPLIT_Y_MIN=0" \
    --variant "s8h:new:X_SPLIT_Y_SRCS=4/8" --variant "r4:new:SLAB_ROWS=-4,Y_CHUNKS=4" \
    --rounds 2 --calls 200 --json "$OUT/wall.json"
  step tests 24 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/service/test_launch_split.py tests/kernels/test_cuda_pairs.py \
    -k "wgmma_row_chunks_on_the_gpu or halves_by_y_on_the_gpu or test_every_table_shape"
  python3 bench/table_wall.py --old "$OLD" --write-old "$OUT/old_table.json"
  step table_ab 12 python3 bench/kernels.py --table-ab "$OUT/old_table.json" \
    --shapes 14336x4096,18944x3584 --ns 64 --columns auto --iters 30
  wall_report | table
  exit 0
fi
if [[ ${PHASE} == b ]]; then
  D='#include "q6k_matmul.cu"'
  V=(--variant "$(printf "sp|$D|#define Q6SERVE_KS_SPREAD 1\n$D")" --variant "ns||")
  C="4096x14336:16,18944x3584:16,3584x18944:16,3584x3584:64,4096x4096:64,14336x4096:64"
  C+=",18944x3584:64,4096x14336:64,4096x4096:16"
  L=nt8.m1.w12.s8.pf
  C+=",3584x3584:64:$L.k5,4096x4096:64:$L.k6,14336x4096:64:$L.k6"
  step spread 55 python3 bench/wg_ab.py "${V[@]}" --nopost sp,ns --auto --cells "$C" \
    --rounds 2 --iters 30 --recheck 3 --json "$OUT/spread.json"
  {
    echo "== k session 25 PHASE=b (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# spread: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/spread.log" 2>/dev/null | sed -E 's/ +/ /g'
  } | table
  exit 0
fi
if [[ ${PHASE} == c ]]; then
  W="nt=8,src=8,pf=1"
  A="64:$W,warps=12,ksplit=2;64:$W,warps=12,ksplit=3;64:$W,warps=12,ksplit=4"
  A+=";64:$W,warps=12,ksplit=6;64:$W,warps=12,ksplit=8;64:$W,warps=8,ksplit=3"
  A+=";64:$W,warps=8,ksplit=4;64:$W,warps=8,ksplit=6"
  A+=";16:nt=2,src=4,pf=1,warps=8,ksplit=4;16:nt=2,src=4,pf=1,warps=8,ksplit=5"
  A+=";16:nt=2,src=4,pf=1,warps=16,ksplit=4;16:nt=2,src=7,pf=1,warps=16,ksplit=2"
  A+=";16:nt=2,src=7,pf=1,warps=8,ksplit=4"
  step ksplit 40 python3 bench/kernels.py --cfg-ab "$A" --no-torch --rounds 2 \
    --shapes 18944x3584,4096x14336,3584x18944,14336x4096 --json "$OUT/ksplit.json"
  {
    echo "== k session 25 PHASE=c (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# ksplit: shape N AUTO us candidate us AUTO/cand rel torch"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/ksplit.log" 2>/dev/null | sed -E 's/ +/ /g'
  } | table
  exit 0
fi
if [[ ${PHASE} == d ]]; then
  O=14336x4096:64:nt8.m1.w8.s4.pf
  step wall 20 python3 bench/table_wall.py --shapes 14336x4096 --ns 64,48 --old "$O" \
    --rounds 2 --calls 200 --json "$OUT/wall.json"
  python3 bench/table_wall.py --old "$O" --write-old "$OUT/old_table.json"
  step table_ab 8 python3 bench/kernels.py --table-ab "$OUT/old_table.json" \
    --shapes 14336x4096 --ns 48,64 --columns auto --iters 30
  step tests 22 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/service/test_launch_split.py tests/kernels/test_cuda_pairs.py \
    -k "wgmma_row_chunks_on_the_gpu or test_every_table_shape"
  wall_report | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
