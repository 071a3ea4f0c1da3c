#!/usr/bin/env bash
# k's bundle-B command (session 13): validates the int8 tile's cheaper pair reader before it
# lands (q6k_mmq_q8 / pair_codes4 as one byte permute + shift with the lane's constants,
# PairSel; 127 registers at nt2 instead of 142), bounded by CALL_S (45 s):
#   1. tests/kernels/test_cuda_pairs.py -k "other_paths or every_table_shape": the int8 tile
#      bit-identical on pair and SoA weights (nt2 there; nt1/2/4/8 through the table's q8_1 cells);
#   2. bench/kernels.py --pairs-ab --precision q8_1 --nts 1,2,8: the int8 tile at 1, 2 and 8
#      n-tiles on SoA and pair copies of the same blocks, alternated, bits compared, on
#      4096x14336 and 18944x3584 at N = 1, 8, 64 (bundle A, the reader before this one:
#      pairs/SoA 0.692 / 0.708 at nt2 N=1/8, 0.861 at nt8 N=64 on 4096x14336).
# Run: `bash bench/gpu_k_s13c.sh` from the tree's root (gpu_session installs the wheels).
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s13c.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks13c
CALL_S=${CALL_S:-45}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
t=$(bound 20 18)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=18 \
  tests/kernels/test_cuda_pairs.py -k "other_paths or every_table_shape" >"$OUT/pytest_pairs.log" 2>&1
note "# pair tests rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 20 1)
timeout "$t" python3 bench/kernels.py --pairs-ab --precision q8_1 --nts 1,2,8 --no-torch \
  --shapes 4096x14336,18944x3584 --ns 1,8,64 --iters 20 --json "$OUT/q8_ab.json" \
  >"$OUT/q8_ab.log" 2>&1
note "# q8_1 pairs-ab rc=$? (bound ${t} s) $(elapsed)"
echo "== k bundle B (tree $(cat COMMIT 2>/dev/null || echo '?'))"
echo "pytest_pairs: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_pairs.log" 2>/dev/null | tail -1)"
grep -E '^(FAILED|ERROR) ' "$OUT/pytest_pairs.log" 2>/dev/null | head -4 | cut -c1-200
echo "# q8_1 SoA vs pairs (shape N shape-of-tile SoA-us pairs-us x=SoA/pairs bits)"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/q8_ab.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $6, $8, $9}'
(cd "$OUT" && tar czf "$FINAL/k_s13c_logs.tgz" -- *)
note "# done $(elapsed)"
