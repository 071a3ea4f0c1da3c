#!/usr/bin/env bash
# k's bundle-B command (session 14), bounded by CALL_S (105 s):
#   1. the landing check: bench/kernels.py --table-ab against the table main had
#      (bench/results/2026-12-02_dispatch_h200_ca935db.json), every changed cell (4096x14336
#      N=64, auto and f16) old/new alternated twice (the 14336x4096 / 18944x3584 N=32 cells
#      stay: nt4.w16 is one launch round there, which turns their y row chunks off);
#   2. the GPU tests of the new launch shapes: tests/kernels/test_cuda_ks14.py and
#      test_cuda_pairs.py::test_every_table_shape (every launch shape the new table names, pair
#      and SoA bits the same, within bound of the float64 reference). q6k_ks_f16's code is
#      unchanged (only nvcc-check instantiations were added), so test_cuda_ks.py is not re-run;
#   3. --cfg-ab of 32-row warp tiles (mt=2) at 4 n-tiles, with and without the prefetch (ptxas
#      sm_90 pair: 254 / 178 registers, no spills), at N = 32/64 (two token chunks at 64);
#   4. Nsight Compute (--set full) of today's AUTO tile at N=1 and N=16 on 4096x14336 (pair
#      weights): the profiles of the N <= 8 and N = 16 targets for today's tiles.
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
t=$(bound 30 70)
timeout "$t" python3 bench/kernels.py --table-ab "$OLD" --columns auto,f16 --iters 40 \
  --shapes "$AB_SHAPES" --ns "$AB_NS" --json "$OUT/table_ab.json" >"$OUT/table_ab.log" 2>&1
note "# table-ab rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 45 25)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
  tests/kernels/test_cuda_ks14.py "tests/kernels/test_cuda_pairs.py::test_every_table_shape" \
  >"$OUT/pytest.log" 2>&1
note "# tests rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 16 12)
timeout "$t" python3 bench/kernels.py --cfg-ab "64:nt=4,mt=2,src=4;64:nt=4,mt=2,src=4,pf=1;32:nt=4,mt=2,src=4;32:nt=4,mt=2,src=4,pf=1" \
  --rounds 2 --iters 20 --no-torch --shapes 4096x14336,14336x4096,18944x3584 \
  --json "$OUT/cfg_ab_mt2.json" >"$OUT/cfg_ab_mt2.log" 2>&1
note "# cfg-ab mt2 rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 30 1)
if command -v ncu >/dev/null && ((t > 10)); then
  timeout "$t" ncu --clock-control none --set full -k "regex:q6k_(ks|wg|mma)_f16" --launch-count 2 \
    -o "$OUT/ncu_n1_16" -f python3 bench/tile_probe.py --profile --no-torch --shapes 4096x14336 \
    --ns 1,16 --profile-cfgs "" >"$OUT/ncu_run.log" 2>&1
  note "# ncu rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu_n1_16.ncu-rep" --page details >"$OUT/ncu_n1_16_details.txt" 2>&1
  ncu --import "$OUT/ncu_n1_16.ncu-rep" --page raw --csv >"$OUT/ncu_n1_16_raw.csv" 2>&1
  rm -f "$OUT/ncu_n1_16.ncu-rep"
fi
echo "== k bundle B (tree $(cat COMMIT 2>/dev/null || echo '?'))"
echo "pytest: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest.log" 2>/dev/null | tail -1)"
grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" 2>/dev/null | head -4 | cut -c1-200
grep -E "^# compiled|Error" "$OUT/table_ab.log" 2>/dev/null | head -3 | cut -c1-200
echo "# table-ab: shape N column old-pick us new-pick us TB/s old/new"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/table_ab.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
echo "# cfg-ab mt2: shape N AUTO us cand us AUTO/cand rel"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/cfg_ab_mt2.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $5, $6, $7, $8}'
echo "# ncu N=1,16 AUTO: $(grep -E '^ +(Duration|DRAM Throughput|Registers Per Thread|Issue Slots Busy) ' "$OUT/ncu_n1_16_details.txt" 2>/dev/null | awk '{$1=$1};1' | head -8 | tr '\n' ';')"
(cd "$OUT" && tar czf "$FINAL/k_s14b_logs.tgz" -- *)
note "# done $(elapsed)"
