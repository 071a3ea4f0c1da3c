#!/usr/bin/env bash
# k's device command, session 22 (issue 16 item 2: the ring K-slice tile q6k_ksr_f16, src 5,
# out of the product code; branch k-src5-out), bounded by BOUND (s). It lands only after this.
# Bundle A (PHASE=a, bound 100; `PHASE=a BOUND=96 bash bench/k_s22.sh`):
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
  {
    echo "== k bundle a (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# tableab: changed cells (0 expected)"
    grep -E "^# compiled|^ *[0-9]+x[0-9]+ +[0-9]+ +(auto|f16) " "$OUT/tableab.log" 2>/dev/null
    echo "# auto (f16, us TB/s): shape N pick"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ +auto" "$OUT/auto.log" 2>/dev/null | sed -E 's/ +/ /g'
  } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet (session 22 adds its other bundles)"
exit 2
