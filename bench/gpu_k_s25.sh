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
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-75}
note "# setup done $(elapsed)"
OLD=14336x4096:64:nt8.m1.w8.s4.pf,18944x3584:64:nt4.m1.w12.s4.pf
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
  {
    echo "== k session 25 PHASE=a (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# wall: shape N variant pick wall kernel host span pre tail y1 | split, y"
    grep -E "^ *[0-9]+x[0-9]+ |^# per" "$OUT/wall.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# table_ab: shape N column old pick us new pick us TB/s old/new"
    grep -E "^[0-9]+x[0-9]+ " "$OUT/table_ab.log" 2>/dev/null | sed -E 's/ +/ /g'
  } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
