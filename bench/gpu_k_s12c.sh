#!/usr/bin/env bash
# k's bundle-B command (session 12, on main with the pair-stream layout on by default), bounded
# by CALL_S (38 s) inside the lead's closing call:
#   1. bench/kernels.py --tune --pairs on 3584x18944 at N = 16, 32, 64 (f16, no torch; its N=64
#      cell was pair streams' largest loss, 0.967x): each bucket's committed
#      pick timed on pair-stream weights beside every tune candidate ("table ... on pairs" lines):
#      the re-check of the table for the pair layout that session 12's call 2 could not run;
#   2. bench/kernels.py --pairs-ab on 4096x14336 and 152064x3584 at N = 1, 16, 32, 64 (x now
#      uploaded on the backend's stream): bits SoA vs pairs again, and the timings.
# Run: `bash bench/gpu_k_s12c.sh` from the tree's root (gpu_session installs the wheels).
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s12c.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks12c
CALL_S=${CALL_S:-38}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
t=$(bound 18 12)
timeout "$t" python3 bench/kernels.py --tune --pairs --no-torch --iters 30 --shapes 3584x18944 \
  --ns 16,32,64 \
  --table-out "$OUT/pairs_table.json" --json "$OUT/pairs_tune.json" >"$OUT/pairs_tune.log" 2>&1
note "# tune --pairs rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 30 1)
timeout "$t" python3 bench/kernels.py --pairs-ab --no-torch --shapes 4096x14336,152064x3584 \
  --ns 1,16,32,64 --json "$OUT/pairs_ab.json" >"$OUT/pairs_ab.log" 2>&1
note "# pairs-ab rc=$? (bound ${t} s) $(elapsed)"
echo "== k bundle B (tree $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null))"
grep -E "^# compiled|on pairs|FAILED" "$OUT/pairs_tune.log" 2>/dev/null
grep -E "^# compiled|^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/pairs_ab.log" 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/k_s12c_logs.tgz" -- *)
