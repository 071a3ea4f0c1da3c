#!/usr/bin/env bash
# k's device command, session 23 (issue 16 goal 1: src 8's activation staging overlapped with
# its weight math), bounded by BOUND (s); PHASE=a/b/c picks the bundle's part.
# The switches it sets (Q6SERVE_X_PIPE / _X_FIRST / _XP_GROUPS / _X_DIRECT in q6k_matmul.cu /
# q6k_wgmma.cu) are not on main: they are on branch k-s23-exp (fd61a33; bundle A ran 3d49079,
# B / C 31d8410 / fd61a33), docs/KERNELS.md "Session 23". On main the variants compile as
# today's code (the defines are ignored): run it from a checkout of that branch.
# Bundle A (PHASE=a, bound 75): Q6SERVE_X_PIPE (q6k_matmul.cu; off in this tree): the K-slice
# tiles (src 4 / 7) and the wgmma tile (src 8) stage their activations by cp.async in up to 8
# groups of K blocks, group j waited for (named barrier j) just before its first block's math,
# so the later blocks land while the first blocks' math runs instead of all before it. x1 (the
# switch on) against today's code ("now"; c: the same compiled as the variants are, sm_90a, the
# compile-path control for src 4 / 7) and AUTO (the table's cell, the product's module)
# alternated twice in one process (bench/wg_ab.py), bits compared (the same bytes in the same
# places: the same bits expected): AUTO's N=64 cells slower than torch, src 8 at the model's
# splits on two of them, N=32 and N=16 on the 48-56 MB shapes; traces of now and x1 (src 8).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-71}
note "# setup done $(elapsed)"
if [[ ${PHASE:-a} == a ]]; then
  V=(--variant $'x1|#include "q6k_matmul.cu"|#define Q6SERVE_X_PIPE 1\n#include "q6k_matmul.cu"'
     --variant "c||")
  L=nt8.m1.w12.s8.pf
  C="3584x3584:64,4096x4096:64,14336x4096:64,18944x3584:64,4096x14336:64,3584x18944:64"
  C+=",3584x3584:64:$L.k5,14336x4096:64:$L.k6,4096x14336:32,4096x14336:16,14336x4096:16"
  C+=",18944x3584:16"
  step pipe 55 python3 bench/wg_ab.py "${V[@]}" --auto --trace now,x1 --cells "$C" --rounds 2 \
    --iters 30 --json "$OUT/pipe.json"
  {
    echo "== k bundle a (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# pipe: shape N cfg variant us | src 8 now us, now/variant, bits, rel | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/pipe.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# trace: one call each (bench/wg_ab.py --trace)"
    grep -E "^# trace" "$OUT/pipe.log" 2>/dev/null | cut -c9-
  } | table
  exit 0
fi
if [[ ${PHASE} == b ]]; then
  # Bundle B (bound 70): bundle A's x1 (8 groups, the copies issued after the first weight
  # loads) lost on src 4 / 7 (0.65-0.89x) and was mixed on src 8 (0.92-1.06x); its traces put
  # group 0 alone at 5.5-10.7 us, about today's whole staging: the copies wait behind the
  # weight burst of the kernel's start. Here the copies go first (Q6SERVE_X_FIRST) in 1 or 8
  # groups (f1 / f8; f1 has no barrier in the weight loop; named barriers now with immediate
  # ids: A's register ids reserved all 16, halving the 2-CTA tiles' residency), and d1
  # (Q6SERVE_X_DIRECT, src 4 / 7 only): no staging at all, each lane's fragments read from
  # global memory (L1) in the weight loop: no fill before the first block's math (goal 2's
  # N=16 idle SMs). Same alternation, bits compared; traces of now and d1 (src 4 / 7 cells
  # traced too since this tree).
  D='#include "q6k_matmul.cu"'
  P='#define Q6SERVE_X_PIPE 1\n'
  V=(--variant "$(printf "f1|$D|${P}#define Q6SERVE_X_FIRST 1\n#define Q6SERVE_XP_GROUPS 1\n$D")"
     --variant "$(printf "f8|$D|${P}#define Q6SERVE_X_FIRST 1\n$D")"
     --variant "$(printf "d1|$D|#define Q6SERVE_X_DIRECT 1\n$D")")
  L=nt8.m1.w12.s8.pf
  C="14336x4096:64:$L.k6,4096x14336:64,4096x14336:16,14336x4096:16,3584x3584:64,14336x4096:64"
  step first 52 python3 bench/wg_ab.py "${V[@]}" --auto --trace now,d1 --cells "$C" \
    --rounds 2 --iters 30 --json "$OUT/first.json"
  {
    echo "== k bundle b (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# first: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/first.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# trace: one call each (bench/wg_ab.py --trace)"
    grep -E "^# trace" "$OUT/first.log" 2>/dev/null | grep -v "no records" | cut -c9-
  } | table
  exit 0
fi
if [[ ${PHASE} == c ]]; then
  # Bundle C (bound 60): bundle B's measurement (f1: the copies first, one group; d1: no
  # staging on src 4 / 7) on five of its cells, for the case B does not run (B was refused
  # twice for want of a machine); same alternation, bits compared, traces of now and d1.
  D='#include "q6k_matmul.cu"'
  P='#define Q6SERVE_X_PIPE 1\n'
  V=(--variant "$(printf "f1|$D|${P}#define Q6SERVE_X_FIRST 1\n#define Q6SERVE_XP_GROUPS 1\n$D")"
     --variant "$(printf "d1|$D|#define Q6SERVE_X_DIRECT 1\n$D")")
  L=nt8.m1.w12.s8.pf
  C="14336x4096:64:$L.k6,4096x14336:16,14336x4096:16,3584x3584:64,4096x14336:64"
  step first 42 python3 bench/wg_ab.py "${V[@]}" --auto --trace now,d1 --cells "$C" \
    --rounds 2 --iters 30 --json "$OUT/first.json"
  {
    echo "== k bundle c (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# first: shape N cfg variant us | now us, now/variant, bits, rel | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/first.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# trace: one call each (bench/wg_ab.py --trace)"
    grep -E "^# trace" "$OUT/first.log" 2>/dev/null | grep -v "no records" | cut -c9-
  } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
