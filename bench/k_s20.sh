#!/usr/bin/env bash
# k's device command, session 20 (issue 16), bounded by BOUND (s). Bundle A:
#   1. pytest: the GPU test of the wgmma tile's variants (src 8: the block scale folded into A,
#      no wait at block boundaries, pf = two wgmma groups in flight; src 9: src 6 with two groups
#      in flight; tests/kernels/test_cuda_wg_v.py);
#   1b. sum_ab: the split-K sum q6k_sum_parts (float4, the remainder's loads together) against
#      session 19's on every K-split AUTO cell's (K slices, outputs) at N = 8..64, same process,
#      alternated, bits compared (bench/sum_ab.py);
#   1c. pytest_ks: the K-slice tile's GPU test (the sum kernel behind every K split);
#   2. n64: --cfg-ab at N = 64 on the six 11-56 MB shapes slower than torch there (session 19's
#      closing check): AUTO (the table: the K-slice tile) against src 6 / 9 / 8 (pf 0/1) at two
#      and three warpgroups per CTA, the split model's K split, alternated twice in one process,
#      torch's f16 linear beside;
#   3. lmhead: the same on 152064x3584 N=64 (AUTO: src 6 at K split 3) at K split 3 and 0;
#   4. ncu: metrics of AUTO, src 6, src 9 and src 8 (pf) at 12 warps on 4096x14336 N=64;
#   5. splits: forced K splits of AUTO's own tile in the N <= 8 cells of the four 48-56 MB
#      shapes (goal 2), alternated twice in one process per shape.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks20${PHASE:-}
BOUND=${BOUND:-196}
note "# setup done $(elapsed)"
if [[ ${PHASE:-a} == b ]]; then
  # bundle B (bound 100): (1) the variants' GPU test with bundle A's two test errors fixed (K
  # splits whose slice fits a CTA); (2) the K-slice tile's GPU test and (3) sum_ab with the
  # float4 sum only from SUM_VEC_MIN = 2^18 outputs (below it session 19's loop, bundle A:
  # the quarter-size grid lost 3-15% there); (4) every table shape's launch (pair vs SoA bits,
  # the reference) with the src 8 cells; (5) tableab: the src 8 cells against main's table,
  # alternated twice in one process; (6) the lm-head 128256x4096 N=64 (AUTO src 6) and the two
  # tall shapes' N=64 against src 8 at forced K splits
  step pytest 35 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
    tests/kernels/test_cuda_wg_v.py
  step pytest_ks 20 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
    tests/kernels/test_cuda_ks.py
  step sum_ab 15 python3 bench/sum_ab.py --ns 8,16,64 --rounds 2 \
    --shapes 1024x4096,4096x4096,4096x14336,18944x3584,152064x3584 --json "$OUT/sum_ab.json"
  step pytest_tables 25 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    -o faulthandler_timeout=60 "tests/kernels/test_cuda_pairs.py::test_every_table_shape"
  step tableab 15 python3 bench/kernels.py --table-ab bench/results/2026-12-03_dispatch_h200_f0a209e.json \
    --columns auto --iters 30 --shapes 4096x14336,3584x18944,152064x3584 --ns 64 --json "$OUT/tableab.json"
  L="64:nt=8,src=8,pf=1,warps=12;64:nt=8,src=8,pf=1,warps=12,ksplit=2;"
  L+="64:nt=8,src=8,pf=1,warps=12,ksplit=3;64:nt=8,src=8,pf=1,warps=12,ksplit=4;"
  step more64 15 python3 bench/kernels.py --cfg-ab "$L" --rounds 2 --iters 20 \
    --shapes 128256x4096,14336x4096,18944x3584 --json "$OUT/more64.json"
  {
    echo "== k bundle b (tree $(tree_commit)), $(elapsed)"
    steps
    echo "# tableab: shape N column old new us ratio"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ +(auto|f16)" "$OUT/tableab.log" 2>/dev/null
    echo "# more64 (cfg-ab): shape N AUTO us | cand us AUTO/cand rel torch"
    grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/more64.log" 2>/dev/null
    echo "# sum_ab: shape N ks outputs s19_us now_us s19/now bits"
    grep -E "^ *[0-9]+x[0-9]+ " "$OUT/sum_ab.log" 2>/dev/null
  } | table
  exit 0
fi
step pytest 45 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/kernels/test_cuda_wg_v.py
step sum_ab 25 python3 bench/sum_ab.py --ns 8,16,32,64 --rounds 3 --json "$OUT/sum_ab.json"
V=""
for w in 8 12; do
  V+="64:nt=8,src=6,pf=1,warps=$w;64:nt=8,src=9,pf=1,warps=$w;"
  V+="64:nt=8,src=8,pf=0,warps=$w;64:nt=8,src=8,pf=1,warps=$w;"
done
# the K-slice tile's GPU test (its split-K sums through q6k_sum_parts: vector and scalar totals,
# PDL, the graph)
step pytest_ks 45 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/kernels/test_cuda_ks.py
step n64 55 python3 bench/kernels.py --cfg-ab "$V" --rounds 2 --iters 30 \
  --shapes 4096x14336,14336x4096,18944x3584,3584x18944,3584x3584,4096x4096 --json "$OUT/n64.json"
L=""
for k in 3 0; do
  L+="64:nt=8,src=9,pf=1,warps=12,ksplit=$k;64:nt=8,src=8,pf=0,warps=12,ksplit=$k;"
  L+="64:nt=8,src=8,pf=1,warps=12,ksplit=$k;"
done
step lmhead 20 python3 bench/kernels.py --cfg-ab "$L" --rounds 2 --iters 20 \
  --shapes 152064x3584 --json "$OUT/lmhead.json"
if command -v ncu >/dev/null; then
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  M+=,sm__cycles_active.avg,gpc__cycles_elapsed.max,sm__warps_active.avg.per_cycle_active
  M+=,launch__registers_per_thread,launch__grid_size,launch__block_size
  M+=,smsp__issue_active.avg.pct_of_peak_sustained_active
  M+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
  M+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  for r in long_scoreboard short_scoreboard wait barrier not_selected math_pipe_throttle \
      mio_throttle lg_throttle; do
    M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  step ncu 25 ncu --clock-control none --metrics "$M" \
    -k "regex:q6k_(ks|wg)_f16|q6k_sum_parts" -o "$OUT/ncu" -f python3 bench/tile_probe.py \
    --profile --no-torch --profile-cfgs \
    "64:nt=8,src=6,pf=1,warps=12;64:nt=8,src=9,pf=1,warps=12;64:nt=8,src=8,pf=1,warps=12" \
    --shapes 4096x14336 --ns 64
  [[ -f $OUT/ncu.ncu-rep ]] && ncu --import "$OUT/ncu.ncu-rep" --page raw --csv >"$OUT/ncu.csv" 2>&1
fi
S=""
for k in 3 5 6 7 9 12 16; do for n in 4 8; do S+="$n:nt=1,src=4,pf=1,warps=8,ksplit=$k;"; done; done
for k in 1 2 3 4; do for n in 1 2; do S+="$n:nt=1,src=2,warps=8,ksplit=$k;"; done; done
step splits_4096x14336 20 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 --no-torch \
  --shapes 4096x14336 --json "$OUT/splits_4096x14336.json"
S=""
for k in 2 3 5 7; do for n in 4 8; do S+="$n:nt=1,src=4,pf=1,warps=8,ksplit=$k;"; done; done
for k in 1 2 3; do S+="1:nt=1,src=2,pf=1,warps=4,ksplit=$k;2:nt=1,src=2,pf=1,warps=8,ksplit=$k;"; done
step splits_18944x3584 15 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 --no-torch \
  --shapes 18944x3584 --json "$OUT/splits_18944x3584.json"
S=""
for k in 4 6 8 10 13 19 25; do S+="8:nt=1,src=4,pf=1,warps=16,ksplit=$k;"; done
for k in 1 2 3 4; do for n in 1 2 4; do S+="$n:nt=1,src=2,warps=8,ksplit=$k;"; done; done
step splits_3584x18944 20 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 --no-torch \
  --shapes 3584x18944 --json "$OUT/splits_3584x18944.json"
S=""
for n in 1 2 4 8; do
  S+="$n:nt=1,src=7,pf=1,warps=8,ksplit=4;$n:nt=1,src=7,pf=1,warps=8,ksplit=8;"
  S+="$n:nt=1,src=4,pf=1,warps=8,ksplit=1;$n:nt=1,src=4,pf=1,warps=8,ksplit=3;"
done
step splits_14336x4096 15 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 --no-torch \
  --shapes 14336x4096 --json "$OUT/splits_14336x4096.json"
{
  echo "== k bundle ${PHASE:-a} (tree $(tree_commit)), $(elapsed)"
  steps
  echo "# cfg-ab (one process per step, alternated): shape N AUTO us | candidates, fastest first: label us AUTO/cand rel"
  python3 - "$OUT" <<'PY'
import glob, os, re, sys
t = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.log"))):
    if os.path.basename(f).startswith(("n64", "lmhead", "splits_")):
        for line in open(f):
            m = re.match(r"\s*(\d+x\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*(\S*)", line)
            if m:
                d = t.setdefault((m[1], int(m[2])), {"auto": (m[3], m[4]), "c": []})
                d["c"].append((float(m[6]), m[5], m[7], m[8]))
                d["torch"] = m[9] or "-"
for (shape, n), d in t.items():
    best = sorted(d["c"])
    print(shape, n, d["auto"][0], d["auto"][1], "torch", d.get("torch", "-"), "|",
          "  ".join(f"{lab} {us:.1f} {x} {rel}" for us, lab, x, rel in best[:6]))
PY
  echo "# sum_ab: shape N ks outputs s19_us now_us s19/now bits"
  grep -E "^ *[0-9]+x[0-9]+ " "$OUT/sum_ab.log" 2>/dev/null
  echo "# ncu: kernel grid block regs us DRAM% warps/SM issue% smem% hmma% | long_sb short_sb wait barrier nsel math mio lg"
  python3 - "$OUT/ncu.csv" <<'PY'
import csv, os, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5] if os.path.exists(sys.argv[1]) else []
if len(rows) > 2:
    h = rows[0]
    g = lambda row, m: row[h.index(m)] if m in h else "?"
    st = "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio"
    for row in rows[2:]:
        name = g(row, "Kernel Name").split("(")[0].replace(" ", "")[:40]
        vals = [g(row, m) for m in ("launch__grid_size", "launch__block_size",
                "launch__registers_per_thread", "gpu__time_duration.sum",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "sm__warps_active.avg.per_cycle_active",
                "smsp__issue_active.avg.pct_of_peak_sustained_active",
                "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
                "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")]
        vals += ["|"] + [g(row, st % s) for s in ("long_scoreboard", "short_scoreboard", "wait",
                 "barrier", "not_selected", "math_pipe_throttle", "mio_throttle", "lg_throttle")]
        print(name, " ".join(vals))
PY
} | table
