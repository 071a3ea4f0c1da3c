#!/usr/bin/env bash
# k's device command, session 19 (issue 16), bounded by BOUND (s). Bundle A (ran on tree c7b30df:
# the two-blocks-ahead loop it measured lost every cell and left the kernel; its code and GPU
# test are bench/results/2026-12-03_k_d2_two_blocks_ahead.patch, apply it to run PHASE=a again):
#   1. d2: --cfg-ab on the four 48-56 MB shapes at N = 1, 2, 4, 8 (the N <= 8 cells short of
#      2.4 TB/s): AUTO (the table) against the two-blocks-ahead tile (nt1 w12 pf) at the
#      occupancy's K split and at 2 / 4 / 8, as the cluster-sum tile (src 7) at 2 / 4, and the
#      one-block tile at 8 warps at K split 2 / 4; at N = 16 the same loop at two n-tiles
#      (the split model's pick is 7-37 there), alternated twice in one process;
#   2. pytest: the GPU test of that loop;
#   3. rule: the same tile against AUTO (the N <= 8 rule's K-slice tile at 8 warps) on two
#      weights above the rule's threshold (27648x5120, 28672x8192).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks19${PHASE:-}
BOUND=${BOUND:-196}
note "# setup done $(elapsed)"
if [[ ${PHASE:-a} == b ]]; then
  # bundle B: (1) splits: the N <= 8 rule's K-slice tile (8 warps, one block ahead) on the
  # weights above its threshold at forced K splits of ~2, 3 and 5 blocks per slice, against
  # AUTO (the split model's: one-block slices on 27648x5120 at N = 1/2, 46.6-47.2 us in bundle
  # A), per shape (the candidates' splits depend on the shape's blocks per row); (2) ncu: AUTO,
  # the two-blocks-ahead tile at 12 warps (its K split and AUTO's) and the one-block tile at 8
  # warps at K split 4, on 4096x14336 N=8 (bundle A: 21.6 / 25.4 / 25.6 us): what the extra
  # block in flight changed
  for shape in 27648x5120 10240x10240 8192x14336 32768x4096 5120x27648 16384x14336 28672x8192 \
      8192x28672; do
    bpr=$((${shape#*x} / 256))
    S=""
    for per in 2 3 5; do
      for n in 1 2 4 8; do S+="$n:nt=1,src=4,pf=1,ksplit=$(((bpr + per - 1) / per));"; done
    done
    step "splits_$shape" 12 python3 bench/kernels.py --cfg-ab "$S" --rounds 2 --iters 30 --no-torch \
      --shapes "$shape" --json "$OUT/splits_$shape.json"
  done
  if command -v ncu >/dev/null; then
    M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    M+=,sm__cycles_active.avg,gpc__cycles_elapsed.max,sm__warps_active.avg.per_cycle_active
    M+=,launch__registers_per_thread,launch__grid_size,launch__block_size
    M+=,smsp__issue_active.avg.pct_of_peak_sustained_active
    for r in long_scoreboard short_scoreboard wait barrier not_selected lg_throttle; do
      M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
    done
    step ncu 30 ncu --clock-control none --metrics "$M" -k "regex:q6k_(ks|ksc)_f16|q6k_sum_parts" \
      -o "$OUT/ncu" -f python3 bench/tile_probe.py --profile --no-torch --profile-cfgs \
      "8:nt=1,src=4,pf=1,warps=12;8:nt=1,src=4,pf=1,warps=12,ksplit=8;8:nt=1,src=4,pf=1,ksplit=4" \
      --shapes 4096x14336 --ns 8
    [[ -f $OUT/ncu.ncu-rep ]] && ncu --import "$OUT/ncu.ncu-rep" --page raw --csv >"$OUT/ncu.csv" 2>&1
  fi
  {
    echo "== k bundle b (tree $(tree_commit)), $(elapsed)"
    steps | grep -v "^splits_"
    echo "# the rule's shapes, forced K splits (one process per shape, alternated): shape N AUTO us | label us AUTO/cand rel"
    cat "$OUT"/splits_*.log | grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " | awk '{print $1, $2, $3, $4, "|", $5, $6, $7, $8}'
    echo "# ncu: kernel grid block regs us DRAM% warps/SM issue% | long_sb short_sb wait barrier nsel lg"
    python3 - "$OUT/ncu.csv" <<'PY'
import csv, os, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5] if os.path.exists(sys.argv[1]) else []
if len(rows) > 2:
    h = rows[0]
    g = lambda row, m: row[h.index(m)] if m in h else "?"
    st = "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio"
    for row in rows[2:]:
        name = g(row, "Kernel Name").split("(")[0].replace(" ", "")[:44]
        vals = [g(row, m) for m in ("launch__grid_size", "launch__block_size",
                "launch__registers_per_thread", "gpu__time_duration.sum",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "sm__warps_active.avg.per_cycle_active",
                "smsp__issue_active.avg.pct_of_peak_sustained_active")]
        vals += ["|"] + [g(row, st % s) for s in ("long_scoreboard", "short_scoreboard", "wait",
                                                  "barrier", "not_selected", "lg_throttle")]
        print(name, " ".join(vals))
PY
  } | table
  exit 0
fi
C=""
for n in 1 2 4 8; do
  for k in 0 2 4 8; do C+="$n:nt=1,src=4,pf=1,warps=12,ksplit=$k;"; done
  for k in 2 4; do C+="$n:nt=1,src=7,pf=1,warps=12,ksplit=$k;"; done
  C+="$n:nt=1,src=4,pf=1,warps=8,ksplit=2;$n:nt=1,src=4,pf=1,warps=8,ksplit=4;"
done
for k in 0 2 4; do C+="16:nt=2,src=4,pf=1,warps=12,ksplit=$k;"; done
C+="16:nt=2,src=7,pf=1,warps=12,ksplit=2;"
step d2 115 python3 bench/kernels.py --cfg-ab "$C" --rounds 2 --iters 30 --no-torch \
  --shapes 4096x14336,18944x3584,3584x18944,14336x4096 --json "$OUT/d2.json"
step pytest 45 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/kernels/test_cuda_ks_d2.py
R=""
for n in 1 2 4 8; do R+="$n:nt=1,src=4,pf=1,warps=12;"; done
step rule 25 python3 bench/kernels.py --cfg-ab "$R" --rounds 2 --iters 30 --no-torch \
  --shapes 27648x5120,28672x8192 --json "$OUT/rule.json"
{
  echo "== k bundle ${PHASE:-a} (tree $(tree_commit)), $(elapsed)"
  steps
  echo "# N<=8 (one process, alternated): shape N AUTO us | candidates, fastest first: label us AUTO/cand rel"
  python3 - "$OUT" <<'PY'
import os, re, sys
t = {}
for line in (l for f in ("d2.log", "rule.log") if os.path.exists(os.path.join(sys.argv[1], f))
             for l in open(os.path.join(sys.argv[1], f))):
    m = re.match(r"\s*(\d+x\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)", line)
    if m:
        d = t.setdefault((m[1], int(m[2])), {"auto": (m[3], m[4]), "c": []})
        d["c"].append((float(m[6]), m[5], m[7], m[8]))
for (shape, n), d in t.items():
    best = sorted(d["c"])
    print(shape, n, d["auto"][0], d["auto"][1], "|",
          "  ".join(f"{lab} {us:.1f} {x} {rel}" for us, lab, x, rel in best))
PY
} | table
