#!/usr/bin/env bash
# Session 13's second own call of k (issue 16), on branch k-pairs (main + the int8 tile's pair
# reader fix, q6k_mmq_q8 / pair_codes4). Bounded by CALL_S (150 s of command; ~240 s of device
# time with the cold start and the idle tail); each step by what is left, in order of need:
#   1. tests/kernels/test_cuda_pairs.py -k "other_paths or every_table_shape": the fixed int8
#      tile bit-identical on pair and SoA weights (and every launch shape the table names);
#   2. bench/kernels.py --pairs-ab --precision q8_1: the int8 tile (the table's q8_1 pick) on SoA
#      and pair copies of the same blocks, alternated, bits compared - this tree, then main's
#      kernels (./base, the reader before the fix; base_tree) on the same machine;
#   3. bench/kernels.py --tune --pairs --confirm 2 (the ten shapes, all columns; the committed
#      table = call 1's is the "previous" one the confirm re-times against): the q8_1 column on
#      the fixed reader; the table it writes is put in place;
#   4. bench/kernels.py --table-ab base/dispatch_e786e72.json: every cell whose pick differs
#      between the new table and the one session 13 started from, old/new alternated (the
#      landing check: no cell slower by > 3%);
#   5. test_cuda_pairs.py -k every_table_shape with the new table;
#   6. the timing floor: an empty kernel timed as bench/kernels.py times a call.
# Send: the TEAM.md recipe with NAME=k, plus main's kernels in .gpu/k/base:
#   git -C /work/main archive fcd47f7 kernels service client proto | tar x -C /work/main/.gpu/k/base
#   git -C /work/main show e786e72:kernels/cuda/dispatch_h200.json > /work/main/.gpu/k/base/dispatch_e786e72.json
#   run(carry=[".gpu/k", ".whl"], command="cd .gpu/k && ln -sfn ../../.whl .whl && bash bench/gpu_k_s13b.sh", timeout_s=165)
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s13b.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks13b
CALL_S=${CALL_S:-150}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
note "# setup done $(elapsed)"
SHAPES=4096x14336,14336x4096,18944x3584,3584x18944,152064x3584,128256x4096,4096x4096,3584x3584
SHAPES+=,1024x4096,512x3584
Q8=4096x14336,18944x3584,152064x3584

t=$(bound 35 100)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=30 \
  tests/kernels/test_cuda_pairs.py -k "other_paths or every_table_shape" >"$OUT/pytest_pairs.log" 2>&1
note "# pair tests rc=$? (bound ${t} s) $(elapsed)"

t=$(bound 25 85)
timeout "$t" python3 bench/kernels.py --pairs-ab --precision q8_1 --no-torch --shapes "$Q8" \
  --ns 1,8,16,64 --json "$OUT/q8_ab.json" >"$OUT/q8_ab.log" 2>&1
note "# q8_1 pairs-ab rc=$? (bound ${t} s) $(elapsed)"

cp kernels/cuda/dispatch_h200.json "$OUT/dispatch_call1.json"
t=$(bound 45 45)
timeout "$t" python3 bench/kernels.py --tune --pairs --no-torch --iters 20 --confirm 2 \
  --shapes "$SHAPES" --commit "$(cat COMMIT 2>/dev/null || echo unknown)" \
  --table-out "$OUT/dispatch_h200.json" --json "$OUT/tune.json" >"$OUT/tune.log" 2>&1
note "# tune rc=$? (bound ${t} s) $(elapsed)"
[[ -s $OUT/dispatch_h200.json ]] && cp "$OUT/dispatch_h200.json" kernels/cuda/dispatch_h200.json

t=$(bound 35 25)
if [[ -f base/dispatch_e786e72.json ]]; then
  timeout "$t" python3 bench/kernels.py --table-ab base/dispatch_e786e72.json --shapes "$SHAPES" \
    --ns 1,2,4,8,16,32,64 --json "$OUT/table_ab.json" >"$OUT/table_ab.log" 2>&1
  note "# table-ab rc=$? (bound ${t} s) $(elapsed)"
fi

t=$(bound 20 12)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=30 \
  tests/kernels/test_cuda_pairs.py -k "every_table_shape" >"$OUT/pytest_table.log" 2>&1
note "# table-shape test rc=$? (bound ${t} s) $(elapsed)"

t=$(bound 20 4)
if [[ -d base/kernels ]] && ((t >= 10)); then
  base_tree base >"$OUT/base.txt" 2>&1
  PYTHONPATH=$BASEPP timeout "$t" python3 bench/kernels.py --pairs-ab --precision q8_1 --no-torch \
    --shapes "$Q8" --ns 1,8,16,64 --json "$OUT/q8_ab_base.json" >"$OUT/q8_ab_base.log" 2>&1
  note "# q8_1 pairs-ab on main's kernels rc=$? (bound ${t} s) $(elapsed)"
fi

t=$(bound 8 0)
timeout "$t" python3 - >"$OUT/floor.log" 2>&1 <<'PY'
import sys
sys.path.insert(0, "bench")
import cupy as cp
import numpy as np
from kernels import time_calls
k = cp.RawKernel('extern "C" __global__ void nop(int* p) { if (p == nullptr) return; }', "nop")
s = cp.cuda.Stream(non_blocking=True)
with s:
    for blocks in (1, 132, 264):
        us = time_calls(cp, lambda i, b=blocks: k((b,), (256,), (np.uint64(0),)), 2, 3, 40)
        print(f"empty kernel, {blocks} CTAs x 256 threads: {us:.2f} us between its events")
PY
note "# floor rc=$? $(elapsed)"

echo "== k s13 call 2 (tree $(cat COMMIT 2>/dev/null || echo '?'))"
for f in pytest_pairs pytest_table; do
  echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" 2>/dev/null | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/$f.log" 2>/dev/null | head -4 | cut -c1-200
done
echo "# q8_1 SoA vs pairs, this tree (us SoA, pairs, x = SoA/pairs, bits) | main's kernels"
paste -d'|' <(grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/q8_ab.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $6, $8, $9}') \
  <(grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/q8_ab_base.log" 2>/dev/null | awk '{print " " $4, $6, $8, $9}')
grep -E "^# (compiled|wrote)" "$OUT/tune.log" 2>/dev/null
echo "# call-2 confirm, AUTO: $(grep -E ' confirm +auto:' "$OUT/tune.log" 2>/dev/null | grep -c -- '-> tuned') tuned / $(grep -E ' confirm +auto:' "$OUT/tune.log" 2>/dev/null | grep -c -- '-> table') kept; q8_1: $(grep -E ' confirm +q8_1:' "$OUT/tune.log" 2>/dev/null | grep -c -- '-> tuned') / $(grep -E ' confirm +q8_1:' "$OUT/tune.log" 2>/dev/null | grep -c -- '-> table')"
echo "# table-ab vs e786e72's table (old/new < 0.97 = slower by > 3%):"
grep -E "^# compiled" "$OUT/table_ab.log" 2>/dev/null
awk '$NF ~ /^[0-9.]+$/ && $2 ~ /^[0-9]+$/ {n++; if ($NF < 0.97) bad++; if ($NF < m || m == "") m = $NF; if ($NF > M) M = $NF} END {print "# cells " n ", slower by > 3%: " bad+0 ", old/new " m " - " M}' "$OUT/table_ab.log" 2>/dev/null
grep -E " auto " "$OUT/table_ab.log" 2>/dev/null | cut -c1-120
cat "$OUT/floor.log" 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/k_s13b_logs.tgz" -- *)
cp "$OUT/dispatch_h200.json" "$FINAL/" 2>/dev/null
note "# done $(elapsed)"
