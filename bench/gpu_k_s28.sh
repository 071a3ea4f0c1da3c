#!/usr/bin/env bash
# k's device command, session 28 (issue 16: N=64 faster than torch on 3584x3584, 4096x4096,
# 18944x3584, 14336x4096; N = 8/16 on the 48-56 MB shapes), bounded by BOUND (s); PHASE picks
# the bundle's part. Session 27's script (PHASE a-d) is in git history (commit 1e0f9dc).
# Both phases ran (bundle A: this script as it was at ef8034d, steps ev q ncu ncu_torch kssweep;
# bundle B: PHASE=b below on tree 4410146) and every switch they set
# lost: Q6SERVE_W_EVICT, Q6SERVE_KS_QUEUE and Q6SERVE_KS_TMA are not on main (they live on branch
# k-s28-lost, commit f9a6f20, TMA 1 the default there); on main their #defines do nothing, so
# the variants run today's kernels. Figures: docs/KERNELS.md "Session 28".
# PHASE=a (bound 100). Variants of bench/wg_ab.py are today's text with a #define before
# q6k_matmul.cu (each 0 = the product's PTX), alternated twice in one process with now (the
# product's module), c0 (the text compiled as the variants are: the control) and AUTO, 30
# calls each, bits compared (the same bits expected: the same values in the same order):
# 1. ks: on the K-slice cells (src 4 / 7) at N=64 of 3584x3584 / 4096x4096 and N = 8/16 of the
#    48-56 MB shapes: x1 = Q6SERVE_KS_TMA 1 (q6k_matmul.cu: the activations staged in x's order
#    by one bulk copy per token row on an mbarrier, issued before the weight loads: no thread
#    loads or stores them; the B fragments read from the permuted granule); x2 = the same with
#    the first weight loads after the copies' wait (as XFIRST orders them); --recheck 1 (a
#    fresh x: state between launches would show).
# 2. q (ask 2, the warp-end spread of multi-round grids): q1 = Q6SERVE_KS_QUEUE 1 (src 4's second
#    and later warp tiles from a counter per K slice instead of the fixed stride) on 18944x3584
#    N = 8/16 (4 tiles a warp), --recheck 2 (stale counters would show), traces of now and q1.
# 3. ev64: ev1 = Q6SERVE_W_EVICT 1 (q6k_common.cuh: the weight streams' loads with an L2
#    evict-first policy, so the partial sums the tile writes and q6k_sum_parts re-reads, and the
#    activations, keep their lines) on the wgmma cells (src 8) of 18944x3584 / 14336x4096 at
#    N=64 (24 / 15 MB of partial sums at K split 5 / 4; the sum is 5-8 us of those calls) and
#    4096x4096 N=64 (src 4).
# 4. ncu (ask 1): Nsight Compute, metrics only, of AUTO's kernels at N=64 on the four shapes
#    (tile and split-K sum).
# 5. kssweep (ask 2): bench/kernels.py --cfg-ab at N = 8 / 16 on the 48-56 MB shapes: AUTO's
#    K-slice launch shapes (nt 1/2 at 8 and 16 warps) at forced K splits 1-6 (fewer slices than
#    AUTO's 7-9: fewer partial-sum bytes, 1 = no sum launch), alternated twice with AUTO.
# 6. ncu_torch (if time is left): torch's f16 linear at N=64 on the four shapes.
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
cfgab_report() {
  echo "# $1: shape N AUTO us candidate us AUTO/cand rel torch"
  grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/$1.log" 2>/dev/null | sed -E 's/ +/ /g'
}
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M+=,dram__bytes_read.sum.per_second,dram__bytes_write.sum,sm__cycles_active.avg
M+=,gpc__cycles_elapsed.max,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread
M+=,launch__grid_size,launch__block_size,smsp__issue_active.avg.pct_of_peak_sustained_active
M+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
M+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
    not_selected lg_throttle; do M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
ncu_auto() {
  ncu --clock-control none --metrics "$1" -k "regex:q6k_(ks|ksc|mma|wg)_f16|q6k_sum_parts" \
    -o "$OUT/ncu_auto" -f python3 bench/tile_probe.py --profile --no-torch --profile-cfgs "" \
    --shapes "$2" --ns 64
}
ncu_torch() {
  ncu --clock-control none --metrics "$1" -k "regex:nvjet|gemm|gemv|cutlass|xmma" \
    -o "$OUT/ncu_torch" -f python3 -c "
import torch
for r, k, n in ((3584, 3584, 64), (4096, 4096, 64), (18944, 3584, 64), (14336, 4096, 64)):
    ws = [torch.randn(r, k, device='cuda', dtype=torch.float16) * 0.02 for _ in range(2)]
    x = torch.randn(n, k, device='cuda', dtype=torch.float16)
    for w in ws:
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    print('# torch', r, k, 'N', n, flush=True)
"
}
ncu_report() {  # the CSV exports, one line per kernel
  echo "# ncu: kernel grid block regs us DRAM% rdTB/s wrMB SMactive% warps/SM issue% smem% hmma% L2hit% | stalls lsb ssb mio math bar wait nsel lg"
  python3 - "$OUT" <<'PY'
import csv, os, sys
for f in ("ncu_auto.csv", "ncu_torch.csv"):
    p = os.path.join(sys.argv[1], f)
    if not os.path.exists(p):
        continue
    rows = [r for r in csv.reader(open(p)) if len(r) > 5]
    if len(rows) < 3:
        print(f, "unreadable:", open(p).read()[:200].replace("\n", " "))
        continue
    h = rows[0]
    g = lambda row, m: row[h.index(m)] if m in h else "?"
    num = lambda s: float(s.replace(",", ""))
    st = "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio"
    for row in rows[2:]:
        try:
            act = 100 * num(g(row, "sm__cycles_active.avg")) / num(g(row, "gpc__cycles_elapsed.max"))
        except ValueError:
            act = float("nan")
        name = g(row, "Kernel Name").split("(")[0].replace(" ", "")[:40]
        vals = [g(row, m) for m in ("launch__grid_size", "launch__block_size",
                "launch__registers_per_thread", "gpu__time_duration.sum",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "dram__bytes_read.sum.per_second", "dram__bytes_write.sum")]
        vals += [f"{act:.0f}"] + [g(row, m) for m in (
            "sm__warps_active.avg.per_cycle_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
            "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
            "lts__t_sector_hit_rate.pct")]
        vals += ["|"] + [g(row, st % s) for s in ("long_scoreboard", "short_scoreboard",
                 "mio_throttle", "math_pipe_throttle", "barrier", "wait", "not_selected", "lg_throttle")]
        print(f[:-4], name, " ".join(vals))
PY
}
export OUT
export -f ncu_auto ncu_torch  # (step's `timeout` runs a command: the functions through bash -c)

if [[ ${PHASE:-a} == a ]]; then
  C="3584x3584:64,4096x4096:64,4096x14336:16,18944x3584:8,4096x14336:8,18944x3584:16"
  C+=",14336x4096:16"
  step ks 34 python3 bench/wg_ab.py --variant "c0||" --variant "x1|$INC|#define Q6SERVE_KS_TMA 1
$INC" --variant "x2|$INC|#define Q6SERVE_KS_TMA 2
$INC" --auto --recheck 1 --cells "$C" --rounds 2 --iters 30 --json "$OUT/ks.json"
  step q 14 python3 bench/wg_ab.py --variant "q1|$INC|#define Q6SERVE_KS_QUEUE 1
$INC" --auto --recheck 2 --trace now,q1 --cells 18944x3584:8,18944x3584:16 \
    --rounds 2 --iters 30 --json "$OUT/q.json"
  step ev64 10 python3 bench/wg_ab.py --variant "ev1|$INC|#define Q6SERVE_W_EVICT 1
$INC" --auto --cells 18944x3584:64,14336x4096:64,4096x4096:64 --rounds 2 --iters 30 \
    --json "$OUT/ev64.json"
  if command -v ncu >/dev/null; then
    step ncu 20 bash -c 'ncu_auto "$1" "$2"' _ "$M" 3584x3584,4096x4096,18944x3584,14336x4096
  else
    note "# no ncu on this machine"
  fi
  A=""
  for k in 1 2 3 4 5 6; do A+="8:nt=1,src=4,pf=1,warps=8,ksplit=$k;16:nt=2,src=4,pf=1,warps=8,ksplit=$k;"; done
  for k in 2 4 6; do A+="8:nt=1,src=4,pf=1,warps=16,ksplit=$k;16:nt=2,src=4,pf=1,warps=16,ksplit=$k;"; done
  step kssweep 20 python3 bench/kernels.py --cfg-ab "$A" --rounds 2 --no-torch \
    --shapes 18944x3584,4096x14336,14336x4096,3584x18944 --json "$OUT/kssweep.json"
  command -v ncu >/dev/null && left 6 && step ncu_torch 10 bash -c 'ncu_torch "$1"' _ "$M"
  for f in ncu_auto ncu_torch; do
    [[ -f $OUT/$f.ncu-rep ]] && ncu --import "$OUT/$f.ncu-rep" --page raw --csv >"$OUT/$f.csv" 2>&1
  done
  { echo "== k session 28 PHASE=a (tree $(tree_commit)), $(elapsed)"; steps; ab_report ks
    ab_report q; ab_report ev64; ncu_report; cfgab_report kssweep; } | table
  exit 0
fi
# PHASE=b (bound 100). Bundle A (tree ef8034d; TMA was not in it): ev1 (weights evict-first in
# L2) 0.982-1.008 of AUTO on every cell (lost), q1 (the tile queue) 0.905-0.923 (lost),
# forced K splits 1-6 at N = 8/16 on the 48-56 MB shapes 0.22-0.998 of AUTO (none wins); ncu
# of AUTO at N=64 (docs/KERNELS.md "Session 28"). This tree: Q6SERVE_KS_TMA 1, the default
# (q6k_matmul.cu: the K-slice tiles' activations staged by one bulk copy per token row on an
# mbarrier, in x's order; same values, same bits expected). Bundle B: lost (old, TMA 0, 1.077-
# 1.120x faster at N=64, 1.099x at 4096x14336 N=16; the same bits); smoke was cut at its 12 s
# by the fresh machine's first compile, so xa never ran (a guard that cost the N <= 16 cells).
# 1. smoke: one cell of the new default (a hung mbarrier would show here: the rest is skipped).
# 2. xa: every K-slice launch shape of the table at N <= 16 (the 48-56 MB shapes, 3584x3584,
#    4096x4096, an lm-head), now (this tree's product module) against old (the text with
#    Q6SERVE_KS_TMA 0: main's PTX) and x2 (TMA 2: the first weight loads after the copies'
#    wait), AUTO beside; bench/wg_ab.py alternated twice in one process, 30 calls each, bits
#    compared (the same bits expected), --recheck 1.
# 3. tests: the K-slice tiles' GPU tests on this tree (test_cuda_ks.py: every launch shape at
#    forced slice counts, every activation dtype (f32 / bf16 take the threads' staging), token
#    counts that leave rows zero, across slabs, the graph path, SoA/AoS and repeat bits;
#    test_cuda_ksc.py: src 7).
# 4. xb: as xa at N = 32/64; 5. tr (if time is left): per-warp traces of now and old on
#    4096x14336 N=16 and 3584x3584 N=64 (the staging's time).
if [[ ${PHASE} == b ]]; then
  V=(--variant "old|$INC|#define Q6SERVE_KS_TMA 0
$INC" --variant "x2|$INC|#define Q6SERVE_KS_TMA 2
$INC")
  if step smoke 12 python3 bench/wg_ab.py --variant "c0||" --cells 4096x14336:8 --rounds 1 \
    --iters 5; then
    C="4096x14336:8,4096x14336:16,18944x3584:8,18944x3584:16,3584x18944:8,3584x18944:16"
    C+=",14336x4096:8,14336x4096:16,3584x3584:8,3584x3584:16,4096x4096:8,4096x4096:16"
    C+=",4096x14336:4,14336x4096:1,128256x4096:8"
    step xa 34 python3 bench/wg_ab.py "${V[@]}" --auto --recheck 1 --cells "$C" --rounds 2 \
      --iters 30 --json "$OUT/xa.json"
  fi
  step tests 26 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_ks.py \
    tests/kernels/test_cuda_ksc.py
  C="3584x3584:64,4096x4096:64,4096x14336:32,18944x3584:32,3584x18944:32,14336x4096:32"
  C+=",3584x3584:32"
  step xb 20 python3 bench/wg_ab.py "${V[@]}" --auto --recheck 1 --cells "$C" --rounds 2 \
    --iters 30 --json "$OUT/xb.json"
  left 8 && step tr 12 python3 bench/wg_ab.py --variant "old|$INC|#define Q6SERVE_KS_TMA 0
$INC" --trace now,old --cells 4096x14336:16,3584x3584:64 --rounds 1 --iters 10 \
    --json "$OUT/tr.json"
  { echo "== k session 28 PHASE=b (tree $(tree_commit)), $(elapsed)"; steps
    echo "# tests"; tail -3 "$OUT/tests.log"; ab_report xa; ab_report xb; ab_report tr; } | table
  exit 0
fi
# PHASE=c (bound 70; bundle C): ask 1 by the sweep (table cells count where they come from it):
# bench/kernels.py --cfg-ab at N=64, alternated 3 times with AUTO, torch beside.
# 1. n64w: the wgmma tile (src 8, nt 8) on the tall weights at K splits 3-8, 12 and 8 warps
#    (AUTO: 18944x3584 w12 k5, 14336x4096 w8 k4; session 26's bundle A timed 18944x3584 w12 k4 at
#    40.3 us against AUTO's 41.4, never put in the table). 2. n64k: the K-slice tiles (src 4 / 7,
#    nt 8, 8 warps) on 3584x3584 / 4096x4096 at K splits 2-7 (AUTO: src 7 k4 / src 4 at the
#    model's split). Ran in bundle C (tree e5b8cb9, 25 s): 18944x3584 w12 k4 1.033 (39.9 vs 41.2
#    us) but not tabled (it loses the two-slab row chunks: docs/KERNELS.md "Session 28"); the
#    rest within 1% or slower.
if [[ ${PHASE} == c ]]; then
  A=""
  for k in 3 4 5 6 7 8; do A+="64:nt=8,src=8,pf=1,warps=12,ksplit=$k;"; done
  for k in 3 4 5 6; do A+="64:nt=8,src=8,pf=1,warps=8,ksplit=$k;"; done
  step n64w 34 python3 bench/kernels.py --cfg-ab "$A" --rounds 3 --shapes 18944x3584,14336x4096 \
    --json "$OUT/n64w.json"
  A=""
  for k in 2 3 4 5 6 7; do A+="64:nt=8,src=4,pf=1,warps=8,ksplit=$k;"; done
  for k in 2 4 7; do A+="64:nt=8,src=7,pf=1,warps=8,ksplit=$k;"; done
  step n64k 26 python3 bench/kernels.py --cfg-ab "$A" --rounds 3 --shapes 3584x3584,4096x4096 \
    --json "$OUT/n64k.json"
  { echo "== k session 28 PHASE=c (tree $(tree_commit)), $(elapsed)"; steps; cfgab_report n64w
    cfgab_report n64k; } | table
  exit 0
fi
# PHASE=d (bound 80; bundle D, the second shift's asks). Bundle C's K-split sweep at N=64 read
# through a model (device-less Launcher.plan): time ~ 2.6 us x rounds x blocks a slice (the
# critical path of a warpgroup) + 0.43 us a MB of split-K partials (k4 .. k8 of w12 on
# 18944x3584 all have 12 such units: 39.9 .. 46.1 us with 19 .. 34 MB of partials; k3 has 15).
# Ran in bundle D (tree 7e15493, 29 s): wgh lost (h1 / c0 0.965-1.016, 0.972 where it slices as
# today: the per-half branch costs ~3%, the skipped steps save nothing: the boundary blocks'
# loads stay), so Q6SERVE_WG_HALF is not on main (branch k-s28-half, commit 7e15493; on main the
# h1 variant's text is not found and wg_ab stops); wall: k4 whole ties k5 whole and loses to
# main's k5 chunks (N=64 0.94-0.97, N=48 0.93), k4 in 3 chunks of one round 1.04 / 1.005 of main
# (docs/KERNELS.md "Session 28, second shift").
# (steps run wall, then wgh with the rest of the bound)
# 1. wgh (ask 1, what is buildable now): Q6SERVE_WG_HALF 1 (q6k_wgmma.cu, bench-only, 0 = the
#    product's PTX: nvcc -ptx sm_90a equal to main's): K slices in half blocks, so 18944x3584 at
#    K split 4 takes 3.5 blocks a slice (model: 12 -> 10.5 units, ~36 us), 14336x4096 at split 3
#    5.5 (w12: 2 rounds, 12 -> 11); each slice stages and loads the whole blocks it touches and
#    skips the wgmma steps of a half outside it. bench/wg_ab.py on the same launch plans, h1
#    against now (the product module at that launch shape), c0 (today's text compiled as the
#    variants are) and AUTO, alternated twice, 30 calls each; y against AUTO's (rel: other K
#    slices round otherwise, ~2-3e-4 as k4 vs k5); the AUTO cell (k5: half slices = its block
#    slices) must give now's bits (same). nvcc sm_90a, pair streams: 163 / 165 registers at 12 /
#    8 warps (main 159 / 163), 0 spills.
# 2. wall (ask 2): the k4 cell (33 CTAs x 3 rounds of 6336 rows) cannot be cut into row chunks of
#    whole rounds on the two storage slabs (9472 rows each: Launcher.row_chunks refuses 2 + 2
#    rounds), so its 4.8 MB y would go down after the whole kernel; a copy in 3 slabs of one
#    round (6336 rows) can: 2 chunks 12672 | 6272 (2 + 1 rounds) or 3 of one round each (no
#    product rule: such slabs cost the K-slice cells at N = 16/32 their chunks, 4736 rows a
#    round; it measures whether chunk cuts inside a slab are worth building).
#    bench/table_wall.py staged calls, alternated forward and back twice in one process: old (k4:
#    2 slabs, whole), new (main: k5 in 2 slab chunks), k4s3 / k4c3 (k4 on the 3-slab copy, 2 / 3
#    chunks), whole (k5 unsplit); N = 64, 48. Same pick, same bits (DIFFER: rc 1).
if [[ ${PHASE} == d ]]; then
  step wall 30 python3 bench/table_wall.py --shapes 18944x3584 --ns 64,48 \
    --old 18944x3584:64:nt8.m1.w12.s8.pf.k4 --variant "k4s3:old:SLAB_ROWS=6336,Y_CHUNKS=2" \
    --variant "k4c3:old:SLAB_ROWS=6336,Y_CHUNKS=3" --variant "whole:new:Y_CHUNKS=0" \
    --rounds 2 --calls 200 --json "$OUT/wall.json"
  # 12-warp cells first (one kernel per variant), then 8 warps, then the small weights
  C="18944x3584:64:nt8.m1.w12.s8.pf.k4,18944x3584:64,14336x4096:64:nt8.m1.w12.s8.pf.k3"
  C+=",18944x3584:48:nt8.m1.w12.s8.pf.k4,14336x4096:64:nt8.m1.w8.s8.pf.k3"
  C+=",18944x3584:64:nt8.m1.w8.s8.pf.k4,4096x4096:64:nt8.m1.w8.s8.pf.k3"
  C+=",3584x3584:64:nt8.m1.w8.s8.pf.k4"
  step wgh 70 python3 bench/wg_ab.py --variant "c0||" --variant "h1|#define Q6SERVE_WG_HALF 0|#define Q6SERVE_WG_HALF 1" \
    --auto --cells "$C" --rounds 2 --iters 30 --json "$OUT/wgh.json"
  { echo "== k session 28 PHASE=d (tree $(tree_commit)), $(elapsed)"; steps; ab_report wgh
    echo "# wall: shape N variant pick wall kernel host span pre tail y1 | split, y"
    grep -E "^ *[0-9]+x[0-9]+ |^# per|DIFFER" "$OUT/wall.log" 2>/dev/null | sed -E 's/ +/ /g'
  } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
