#!/usr/bin/env bash
# k's device command, session 24 (issue 16 goal 1: N = 16..64), bounded by BOUND (s); PHASE picks
# the bundle's part.
# Bundle B (PHASE=a, bound 70):
# 1. xfirst: this tree's wgmma tile (src 8) stages f16 activations by cp.async issued before its
#    first weight loads (Q6SERVE_WG_XFIRST, on; bundle A ran it as session 23's X_FIRST with one
#    group: 1.033x on 4096x14336 N=64, 1.087x on 14336x4096 N=64 at K split 6); "old" = the same
#    file with it off (the staging of before). Today's ("now", the product's module) against old
#    and AUTO, alternated twice in one process (bench/wg_ab.py), bits compared (same expected):
#    AUTO's src 8 cells, a partial token chunk (N=40) and src 8 at the model's K splits on the
#    N=64 cells AUTO gives the K-slice tile.
# 2. fuse: every K-slice / wgmma cell with a K split ends in a second kernel, q6k_sum_parts
#    (PDL-launched after src 4, plainly after src 8). Three kernels against today's:
#    fz  Q6SERVE_KS_FUSE: the sum inside the tile (the last CTA of each row group's K slices,
#        by an atomic ticket, adds the group's partials in slice order: the same bits), no sum
#        launch;
#    ns  today's tile without the sum launch (y incomplete: DIFFER): the sum's whole cost, the
#        most any fused sum can win;
#    pd  today's tile with its sum launched by PDL whatever the src (src 8's cells).
#    (Q6SERVE_KS_FUSE lost and stays on branch k-s24-fuse; without it fz runs as ns.)
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-70}
note "# setup done $(elapsed)"
if [[ ${PHASE:-a} == a ]]; then
  L=nt8.m1.w12.s8.pf
  C="4096x14336:64,3584x18944:64,4096x14336:40,14336x4096:64:$L.k6,3584x3584:64:$L.k5"
  C+=",18944x3584:64:$L.k5"
  step xfirst 28 python3 bench/wg_ab.py \
    --variant "old|#define Q6SERVE_WG_XFIRST 1|#define Q6SERVE_WG_XFIRST 0" --auto \
    --cells "$C" --rounds 2 --iters 30 --json "$OUT/xfirst.json"
  D='#include "q6k_matmul.cu"'
  V=(--variant "$(printf "fz|$D|#define Q6SERVE_KS_FUSE 1\n$D")" --variant "ns||"
     --variant "pd||")
  C="4096x14336:16,3584x3584:64,4096x14336:64,18944x3584:16,14336x4096:32,4096x4096:16"
  step fuse 27 python3 bench/wg_ab.py "${V[@]}" --nopost fz,ns --pdl pd --auto --cells "$C" \
    --rounds 2 --iters 30 --json "$OUT/fuse.json"
  {
    echo "== k bundle b, PHASE=a (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# xfirst: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/xfirst.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# fuse: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/fuse.log" 2>/dev/null | sed -E 's/ +/ /g'
  } | table
  exit 0
fi
if [[ ${PHASE} == b ]]; then
  # Bundle C (bound 50): the GPU tests of the wgmma tile on this tree, whose f16 staging is
  # the cp.async one bundle B measured (the session's closing check ran on main without it):
  # every launch shape of the tile against the float64 reference, tokens past N zero-filled,
  # extreme scales, f32 / bf16 activations (wg_stage_x), across slabs, SoA/AoS bits; then
  # every table cell's launch shape, pair vs SoA bits and the reference (src 8 cells among them).
  step wg_tests 30 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_wg.py
  step table_shapes 20 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/kernels/test_cuda_pairs.py -k test_every_table_shape
  {
    echo "== k bundle c, PHASE=b (tree $(tree_commit)), $(elapsed)"
    steps
  } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
