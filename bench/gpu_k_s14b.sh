#!/usr/bin/env bash
# k's bundle-B command (session 14): validates what lands, bounded by CALL_S (105 s):
#   1. the GPU tests of the changed kernel (q6k_ks_f16: its XA option and the new launch
#      shapes): tests/kernels/test_cuda_ks14.py, tests/kernels/test_cuda_ks.py, and
#      test_cuda_pairs.py -k every_table_shape (every launch shape the new table names, pair
#      and SoA bits the same, within bound of the float64 reference);
#   2. the landing check: bench/kernels.py --table-ab against the table main had
#      (bench/results/2026-12-02_dispatch_h200_ca935db.json), every changed cell old/new
#      alternated twice, torch not timed (bundle A has it).
# Run: `bash bench/gpu_k_s14b.sh` from the tree's root (gpu_session installs the wheels).
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s14b.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks14b
CALL_S=${CALL_S:-105}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
OLD=bench/results/2026-12-02_dispatch_h200_ca935db.json
AB_SHAPES=${AB_SHAPES:-4096x14336,14336x4096,18944x3584}
AB_NS=${AB_NS:-32,64}
t=$(bound 36 64)
timeout "$t" python3 bench/kernels.py --table-ab "$OLD" --columns auto,f16 --iters 40 \
  --shapes "$AB_SHAPES" --ns "$AB_NS" --json "$OUT/table_ab.json" >"$OUT/table_ab.log" 2>&1
note "# table-ab rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 40 20)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=35 \
  tests/kernels/test_cuda_ks14.py "tests/kernels/test_cuda_pairs.py::test_every_table_shape" \
  >"$OUT/pytest.log" 2>&1
note "# tests rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 60 1)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=50 \
  tests/kernels/test_cuda_ks.py >"$OUT/pytest_ks.log" 2>&1
note "# test_cuda_ks rc=$? (bound ${t} s) $(elapsed)"
echo "== k bundle B (tree $(cat COMMIT 2>/dev/null || echo '?'))"
for f in pytest pytest_ks; do
  echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" 2>/dev/null | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/$f.log" 2>/dev/null | head -4 | cut -c1-200
done
grep -E "^# compiled|Error" "$OUT/table_ab.log" 2>/dev/null | head -3 | cut -c1-200
echo "# table-ab: shape N column old-pick us new-pick us TB/s old/new"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/table_ab.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
(cd "$OUT" && tar czf "$FINAL/k_s14b_logs.tgz" -- *)
note "# done $(elapsed)"
