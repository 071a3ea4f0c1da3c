#!/usr/bin/env bash
# k's device command, session 21 (issue 16), bounded by BOUND (s). Bundle A:
#   1. pytest: the wgmma tile's GPU test after src 6 / 9 left it (tests/kernels/test_cuda_wg.py:
#      src 8 only, at 8 and (new) 4 n-tiles, every shape x slice count, extreme scales, zero
#      rows, dtypes, slabs), the K-slice tests that include it (test_cuda_ks.py) and every table shape's launch (pair vs
#      SoA bits, the float64 reference: test_cuda_pairs.py::test_every_table_shape);
#   2. wg_ab (at tree 7a7eded also session 20's q6k_wgmma.cu, bench/ab/q6k_wgmma_s20.cu there,
#      V = 3, against today's on the src 8 cells: the same plan, alternated in one process, bits
#      compared; that copy left after bundle A) (goal 3) today's with three wgmma groups in flight (w3: wait_group 3; 165
#      registers at 3 warpgroups on pair streams, no spills), also on the two tall weights at
#      their model's K split;
#   3. anomaly (goal 1: 14336x4096 N=8 read 69.9 us in session 20's closing check): the cell
#      re-timed in two processes and orders, every call's spread and the host's enqueue time
#      beside it (bench/kernels.py --samples; time_calls now retimes behind a longer spin where
#      the spin ended before the last call was queued), GPU clocks and throttle reasons around;
#   4. n32: the wgmma tile's 32-token form (src 8 nt 4, m64n32k16: new) at N = 32 on the four
#      48-56 MB weights, --cfg-ab against AUTO (the K-slice tile), torch beside (goal 3);
#   5. small64: the wgmma tile (src 8) at 2/3 warpgroups and forced K splits, and as two
#      32-token chunks (nt 4), on the 11-14 MB weights at N = 64 (goal 3), --cfg-ab.
# Bundle B (PHASE=b, bound 130):
#   1. pytest: test_cuda_wg.py with the 32-token form (nt 4) beside nt 8;
#   2. spin0: the anomaly's mechanism: 14336x4096 N = 4/8/16 timed with no spin kernel ahead of
#      the calls (--spin-cycles 0: the GPU waits on the host between calls, as when a slow host
#      outruns the spin), beside the default (bundle A: the host enqueues a call in 73-137 us,
#      the spin buys ~200 us per call);
#   3. n32: the 32-token wgmma tile (src 8 nt 4) at N = 32 on the four 48-56 MB weights and the
#      two lm-heads, --cfg-ab against AUTO, torch beside;
#   4. n64c: the same as two 32-token chunks at N = 64 on the 11-14 MB weights.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks21${PHASE:-}
BOUND=${BOUND:-196}
note "# setup done $(elapsed)"
clocks() {
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,power.draw,temperature.gpu \
    --format=csv,noheader 2>&1 | head -2
}
cfgab_table() {  # cfg-ab logs -> shape N AUTO us torch | the five best candidates
  python3 - "$@" <<'PY'
import os, re, sys
rows = {}
for f in sys.argv[1:]:
    if not os.path.exists(f):
        continue
    for line in open(f):
        m = re.match(r"\s*(\d+x\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*(\S*)", line)
        if m:
            d = rows.setdefault((m[1], m[2]), {"auto": f"{m[3]} {m[4]}", "torch": m[9], "c": []})
            d["c"].append((float(m[6]), m[5], m[7], m[8]))
for (s, n), d in rows.items():
    best = sorted(d["c"])[:5]
    print(s, n, d["auto"], "torch", d["torch"], "|", "  ".join(f"{l} {u:.1f} {x} {r}" for u, l, x, r in best))
PY
}
if [[ ${PHASE:-a} == c ]]; then
  # bundle C (bound 100): bundle B's two table cells (the lm-heads' N=32 on the 32-token wgmma
  # tile) checked: every table shape's launch (pair vs SoA bits, the reference) and --table-ab
  # against main d1a3fcc's table, old / new alternated twice in one process; then the
  # 152064x3584 cell's K split (B: k2 171.3, k4 201.2, the model's 243.7 us) at 2 / 3 against
  # AUTO (now k2), alternated twice in one process
  step pytest_tables 30 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    -o faulthandler_timeout=60 "tests/kernels/test_cuda_pairs.py::test_every_table_shape"
  step tableab 25 python3 bench/kernels.py --table-ab bench/results/2026-12-03_dispatch_h200_d1a3fcc.json \
    --columns auto --iters 30 --shapes 152064x3584,128256x4096 --ns 32 --json "$OUT/tableab.json"
  S="32:nt=4,src=8,pf=1,warps=12,ksplit=3;32:nt=4,src=8,pf=1,warps=8,ksplit=2;"
  S+="32:nt=4,src=8,pf=1,warps=8,ksplit=3;"
  step k3 20 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 --shapes 152064x3584 \
    --json "$OUT/k3.json"
  {
    echo "== k bundle c (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# tableab: shape N column old new us ratio"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ +(auto|f16)" "$OUT/tableab.log" 2>/dev/null
    echo "# k3 (cfg-ab): shape N AUTO us torch | cand us AUTO/cand rel"
    cfgab_table "$OUT/k3.log"
  } | table
  exit 0
fi
if [[ ${PHASE:-a} == b ]]; then
  step pytest 50 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
    tests/kernels/test_cuda_wg.py
  step spin0 12 python3 bench/kernels.py --paths auto --dtypes f16 --ns 4,8,16 --shapes 14336x4096 \
    --samples --no-torch --spin-cycles 0 --repeat 2 --json "$OUT/spin0.json"
  S=""
  for w in 8 12; do S+="32:nt=4,src=8,pf=1,warps=$w;"; done
  S+="32:nt=4,src=8,pf=1,warps=12,ksplit=2;32:nt=4,src=8,pf=1,warps=12,ksplit=4;"
  step n32 45 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 \
    --shapes 4096x14336,3584x18944,14336x4096,18944x3584,152064x3584,128256x4096 \
    --json "$OUT/n32.json"
  S="64:nt=4,src=8,pf=1,warps=12;64:nt=4,src=8,pf=1,warps=8;64:nt=4,src=8,pf=1,warps=12,ksplit=1;"
  step n64c 12 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 \
    --shapes 3584x3584,4096x4096 --json "$OUT/n64c.json"
  {
    echo "== k bundle b (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# spin0: 14336x4096 with no spin ahead (us TB/s; # min p10 p50 p90 max, host us/call)"
    grep -A1 -E "^ *14336x4096 +(4|8|16) +auto" "$OUT/spin0.log" 2>/dev/null | grep -v "^--" \
      | sed -E 's/ +/ /g' | cut -c1-150
    echo "# n32, n64c (cfg-ab): shape N AUTO us torch | cand us AUTO/cand rel (best 5)"
    cfgab_table "$OUT/n32.log" "$OUT/n64c.log"
  } | table
  exit 0
fi
step pytest 85 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/kernels/test_cuda_wg.py tests/kernels/test_cuda_ks.py \
  "tests/kernels/test_cuda_pairs.py::test_every_table_shape"
C="4096x14336:64,3584x18944:64,14336x4096:64:nt8.m1.w12.s8.pf,18944x3584:64:nt8.m1.w12.s8.pf"
C+=",152064x3584:64,128256x4096:64"
step wg_ab 40 python3 bench/wg_ab.py --rounds 3 --iters 30 --cells "$C" \
  --variant 'w3|wg_wait<2>();|wg_wait<3>();' --json "$OUT/wg_ab.json"
clocks >"$OUT/clocks_before.txt"
# the closing check's order around the cell (1024x4096 before it, 4096x14336 after), torch beside
step anomaly1 20 python3 bench/kernels.py --paths auto --dtypes f16 --ns 1,4,8,16,64 \
  --shapes 1024x4096,14336x4096,4096x14336 --samples --json "$OUT/anomaly1.json"
clocks >"$OUT/clocks_mid.txt"
# the cell alone, N = 8 between its neighbours and three times in a row, no torch
step anomaly2 12 python3 bench/kernels.py --paths auto --dtypes f16 --ns 16,8,4,8 --repeat 3 \
  --shapes 14336x4096 --samples --no-torch --json "$OUT/anomaly2.json"
clocks >"$OUT/clocks_after.txt"
S=""
for w in 8 12; do S+="32:nt=4,src=8,pf=1,warps=$w;"; done
S+="32:nt=4,src=8,pf=1,warps=12,ksplit=2;32:nt=4,src=8,pf=1,warps=12,ksplit=4;"
step n32 18 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 \
  --shapes 4096x14336,14336x4096,18944x3584,3584x18944 --json "$OUT/n32.json"
S=""
for w in 8 12; do for k in 2 4 7; do S+="64:nt=8,src=8,pf=1,warps=$w,ksplit=$k;"; done; done
S+="64:nt=8,src=8,pf=1,warps=12;64:nt=4,src=8,pf=1,warps=12;64:nt=4,src=8,pf=1,warps=12,ksplit=1;"
step small64 20 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 \
  --shapes 3584x3584,4096x4096 --json "$OUT/small64.json"
{
  echo "== k bundle ${PHASE:-a} (tree $(tree_commit)), $(elapsed)"
  steps
  echo "# wg_ab: shape N cfg kernel us now_us now/it bits-vs-now"
  grep -E "^ *[0-9]+x[0-9]+ " "$OUT/wg_ab.log" 2>/dev/null
  echo "# anomaly: the 14336x4096 rows (us TB/s; # lines: min p10 p50 p90 max, host us/call, spin)"
  for f in anomaly1 anomaly2; do
    echo "## $f"
    grep -A1 -E "^ *14336x4096 +(4|8|16) +auto" "$OUT/$f.log" 2>/dev/null | grep -v "^--" \
      | sed -E 's/ +/ /g' | cut -c1-150
    grep -c "NOT covered" "$OUT/$f.log" 2>/dev/null | sed 's/^/uncovered rows: /'
  done
  echo "# clocks (sm, mem, throttle, power, temp): before / mid / after"
  cat "$OUT"/clocks_before.txt "$OUT"/clocks_mid.txt "$OUT"/clocks_after.txt 2>/dev/null
  echo "# n32, small64 (cfg-ab): shape N AUTO us | cand us AUTO/cand rel torch (best 5)"
  cfgab_table "$OUT/n32.log" "$OUT/small64.log"
} | table
