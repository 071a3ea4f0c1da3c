#!/usr/bin/env bash
# k's device command, session 19 (issue 16), bounded by BOUND (s). Bundle A:
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
