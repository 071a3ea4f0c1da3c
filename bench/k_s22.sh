#!/usr/bin/env bash
# k's device command, session 22 (issue 16 item 2: the ring K-slice tile q6k_ksr_f16, src 5,
# out of the product code; branch k-src5-out), bounded by BOUND (s). It lands only after this.
# Bundle A (PHASE=a, bound 130; `PHASE=a BOUND=126 bash bench/k_s22.sh`):
#   1. tableab: bench/kernels.py --table-ab against main's table (TABLE_OLD, default the
#      committed table, which the branch leaves as main c69b148 has it): it must load (no cell
#      names src 5) and report 0 changed cells of 140 (auto and f16, ten shapes, N = 1..64);
#      first, as it takes ~10 s and must not be what a slow pytest leaves out;
#   2. pytest: every launch shape the committed table names at each of its N buckets (pair vs
#      SoA bits, the float64 reference: test_cuda_pairs.py::test_every_table_shape); the
#      K-slice tile's shapes at forced slice counts and its split-K sum with PDL
#      (test_cuda_ks.py: the PDL test lost its src 5 shape), the cluster-sum cells (src 7:
#      test_cuda_ksc.py) and the wgmma cells (src 8: test_cuda_wg.py): every kernel family a
#      table cell runs (session 21's bundle A ran test_cuda_wg + test_cuda_ks +
#      test_every_table_shape, 19 tests, in 48 s);
#   3. auto (where 14 s are left): AUTO (f16) on the lm-heads and 4096x14336 at N = 16/32/64,
#      where the ring tile last ran, beside session 21's bundle C (152064x3584 N=32 167.4 us,
#      128256x4096 N=32 166.9; another process, so within the ~3% between runs, not an A/B).
# What the CPU showed before (no GPU; `python bench/code_same.py --base main`, to be re-run
# after a rebase): the PTX of every kept instantiation (nvcc -ptx sm_90 of q6k_matmul.cu with
# -DQ6SERVE_NVCC_CHECK, 146 entries, and of the 199 names the backend requests; sm_90a of
# q6k_wgmma.cu, 18) equal to main c69b148's but for label numbers, and every dispatch choice and
# device-less launch plan (20 shapes x 18 N x 4 precisions x 2 flags, 3 layouts x 3 dtypes)
# equal: docs/KERNELS.md "After session 21".
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks22${PHASE:-a}
BOUND=${BOUND:-96}
note "# setup done $(elapsed)"
SHAPES="3584x3584,512x3584,18944x3584,3584x18944,152064x3584,4096x4096,1024x4096,14336x4096"
SHAPES+=",4096x14336,128256x4096"
if [[ ${PHASE:-a} == a ]]; then
  step tableab 12 python3 bench/kernels.py \
    --table-ab "${TABLE_OLD:-kernels/cuda/dispatch_h200.json}" --columns auto,f16 \
    --shapes "$SHAPES" --ns 1,2,4,8,16,32,64 --iters 30 --json "$OUT/tableab.json"
  step pytest 66 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
    "tests/kernels/test_cuda_pairs.py::test_every_table_shape" tests/kernels/test_cuda_ks.py \
    tests/kernels/test_cuda_ksc.py tests/kernels/test_cuda_wg.py
  if left 14; then
    step auto 14 python3 bench/kernels.py --paths auto --dtypes f16 --ns 16,32,64 --no-torch \
      --shapes 152064x3584,128256x4096,4096x14336 --iters 30 --json "$OUT/auto.json"
  fi
  # 4. ncu8 (goal 2's first reading, where 26 s are left): Nsight Compute, metrics only, of src 8
  #    (nt 8, 12 warps, the plan's K split) beside AUTO on two N=64 cells still slower than torch
  #    (3584x3584, 14336x4096): long-scoreboard stalls, DRAM and issue for the weight ring's case.
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  M+=,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,launch__grid_size
  M+=,launch__block_size,smsp__issue_active.avg.pct_of_peak_sustained_active
  M+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  M+=,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,lts__t_sector_hit_rate.pct
  for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
      not_selected lg_throttle; do M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
  if left 26 && command -v ncu >/dev/null; then
    step ncu8 24 ncu --clock-control none --metrics "$M" -k "regex:q6k_(ks|ksc|mma|wg)_f16" \
      python3 bench/tile_probe.py --profile --no-torch \
      --profile-cfgs "64:nt=8,src=8,pf=1,warps=12" --shapes 3584x3584,14336x4096 --ns 64
  fi
  {
    echo "== k bundle a (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# tableab: changed cells (0 expected)"
    grep -E "^# compiled|^ *[0-9]+x[0-9]+ +[0-9]+ +(auto|f16) " "$OUT/tableab.log" 2>/dev/null
    echo "# auto (f16, us TB/s): shape N pick"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ +auto" "$OUT/auto.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# ncu8: kernel, then the metrics (us, DRAM %, warps/SM, issue %, hmma %, stalls)"
    grep -E "q6k_|duration|dram__|warps_active|issue_active|registers|hmma|sectors|hit_rate|stalled" \
      "$OUT/ncu8.log" 2>/dev/null | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' \
      | awk '{$1=$1};1' | cut -c1-100 | head -60
  } | table
  exit 0
fi
if [[ ${PHASE} == b ]]; then
  # Bundle B (goal 2, bound 120; `PHASE=b BOUND=116 bash bench/k_s22.sh`): src 8's weight stream
  # through a warp-private cp.async ring of S stages (bench/ab/q6k_wgmma_ring.cu, S - 1 blocks in
  # flight per warp; today: one block ahead in registers) against today's src 8 on the same plan
  # (bits compared: the ring feeds the same bytes to the same math) and AUTO (the table's cell)
  # in one process, on the N=64 cells slower than torch and the K-long ones. The ring takes
  # 12 x S x 3408 B of shared memory beside the activations (32 KB per K block at N=64), so the
  # cells run at K splits that leave each CTA <= 3 blocks (2 for S = 4). Then (goal 3) ncu16.
  RING=bench/ab/q6k_wgmma_ring.cu
  V=(--variant "r2|#define WG_RING_S 3|#define WG_RING_S 2|$RING|6816"
     --variant "r3|||$RING|10224"
     --variant "r4|#define WG_RING_S 3|#define WG_RING_S 4|$RING|13632")
  L=nt8.m1.w12.s8.pf
  C="3584x3584:64:$L.k5,3584x3584:64:$L.k7,4096x4096:64:$L.k6,4096x4096:64:$L.k8"
  C+=",14336x4096:64:$L.k6,18944x3584:64:$L.k5,3584x18944:64:$L.k25,4096x14336:64:$L.k19"
  step ring 84 python3 bench/wg_ab.py "${V[@]}" --auto --trace now,r3 --cells "$C" --rounds 2 \
    --iters 30 --json "$OUT/ring.json"
  # goal 3's reading (where 20 s are left): Nsight Compute of AUTO at N=16 on two 48 MB shapes
  # (the K-slice tile and its split-K sum): DRAM, SM active over elapsed, stalls
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  M+=,dram__bytes_read.sum,sm__cycles_active.avg,gpc__cycles_elapsed.max
  M+=,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,launch__grid_size
  M+=,launch__block_size,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
  for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
      not_selected lg_throttle; do M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
  if left 20 && command -v ncu >/dev/null; then
    step ncu16 18 ncu --clock-control none --metrics "$M" -k "regex:q6k_(ks|ksc|mma|wg)_f16|q6k_sum_parts" \
      python3 bench/tile_probe.py --profile --no-torch --profile-cfgs "" \
      --shapes 4096x14336,14336x4096 --ns 16
  fi
  {
    echo "== k bundle b (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# ring: shape N cfg variant us | src 8 now us, now/variant, bits, rel vs AUTO | AUTO us, AUTO/variant"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/ring.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# trace: one call each, SM clocks and globaltimer per warp (bench/wg_ab.py --trace)"
    grep -E "^# trace" "$OUT/ring.log" 2>/dev/null | cut -c9-
    echo "# ncu16: kernel, then the metrics"
    grep -E "q6k_|duration|dram__|cycles|warps_active|issue_active|registers|grid_size|hit_rate|stalled" \
      "$OUT/ncu16.log" 2>/dev/null | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' \
      | awk '{$1=$1};1' | cut -c1-100 | head -80
  } | table
  exit 0
fi
if [[ ${PHASE} == c ]]; then
  # Bundle C (goal 2, bound 100; `PHASE=c BOUND=96 bash bench/k_s22.sh`): bundle B's traces put
  # the N=64 tiles' activation staging at 5.8-9.6 us of the kernel (4 loads in flight per
  # thread: 4 dependent L2 round trips). This tree stages with 16 in flight at 4 / 8 n-tiles
  # (Q6SERVE_STAGE_U, q6k_matmul.cu; the K-slice tile src 4 and the wgmma tile src 8); it lands
  # only if it wins here:
  #   1. stage: bench/wg_ab.py, today's tree ("now", 16) against u4 (the same file with 4: the
  #      code on main) and c (this tree's text compiled as the variants are: for src 4 cells the
  #      product builds sm_90, the variants sm_90a), alternated in one process, bits compared,
  #      AUTO's cells at N=64 (src 4 and src 8), src 8 at the model's split on the 11-14 MB
  #      weights, N=32 on 4096x14336; traces of now and u4 on the src 8 cells;
  #   2. pytest: every table cell's launch shape (pair vs SoA bits, the reference), the K-slice,
  #      cluster-sum and wgmma GPU tests on this tree.
  V=(--variant $'u4|#include "q6k_matmul.cu"|#define Q6SERVE_STAGE_U 4\n#include "q6k_matmul.cu"'
     --variant "c||")
  C="3584x3584:64,4096x4096:64,14336x4096:64,18944x3584:64,4096x14336:64,3584x18944:64"
  C+=",3584x3584:64:nt8.m1.w12.s8.pf,4096x4096:64:nt8.m1.w12.s8.pf,4096x14336:32"
  step stage 48 python3 bench/wg_ab.py "${V[@]}" --trace now,u4 --cells "$C" --rounds 2 \
    --iters 30 --json "$OUT/stage.json"
  step pytest 46 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
    "tests/kernels/test_cuda_pairs.py::test_every_table_shape" tests/kernels/test_cuda_ks.py \
    tests/kernels/test_cuda_ksc.py tests/kernels/test_cuda_wg.py
  {
    echo "== k bundle c (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# stage: shape N cfg variant us | now us (16 in flight), now/variant, bits"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/stage.log" 2>/dev/null | sed -E 's/ +/ /g'
    echo "# trace (src 8 cells): now = 16 in flight, u4 = 4"
    grep -E "^# trace" "$OUT/stage.log" 2>/dev/null | cut -c9-
  } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet (session 22 adds its other bundles)"
exit 2
