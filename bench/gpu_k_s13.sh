#!/usr/bin/env bash
# Session 13's first own call of k (issue 16): the dispatch table re-tuned on pair-stream weights
# (the default resident layout since session 12; the committed table was tuned on plain SoA).
#   bench/kernels.py --tune --pairs --confirm 2 over the ten model shapes, N buckets 1..64, f16
#   activations, no torch: every candidate timed on pair weights; then every (shape, bucket,
#   column) whose tuned pick differs from the committed table's is timed again, committed and
#   tuned pick alternated twice each on the same weights, and the tuned pick is written only if
#   that re-timing finds it > 1% faster (kernels.py confirm_shape). The table lands in
#   $OUT/dispatch_h200.json (the committed table's cells the tune did not reach stay in it).
# Then tests/kernels/test_cuda_pairs.py::test_every_table_shape with the new table in place.
# Also offered on pair weights (goal 2, deeper cp.async pipelining): the 3-stage ring at 12/16
# warps and the wgmma tile at N=16 (kernels.py RING_SHAPES_PAIRS).
# The command's wall is bounded by CALL_S (185 s; ~275 s of device time with the cold start and
# the idle tail); the table is written after every shape, so a cut run leaves the shapes it did.
# Send: the TEAM.md recipe with NAME=k, then
#   run(carry=[".gpu/k", ".whl"], command="cd .gpu/k && ln -sfn ../../.whl .whl && bash bench/gpu_k_s13.sh", timeout_s=200)
# CPU rehearsal (the bench fails at once): DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s13.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks13
CALL_S=${CALL_S:-185}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
note "# setup done $(elapsed)"
# the 48-56 MB shapes and the lm-heads first (a cut run keeps what it did)
SHAPES=4096x14336,14336x4096,18944x3584,3584x18944,152064x3584,128256x4096,4096x4096,3584x3584
SHAPES+=,1024x4096,512x3584
t=$(bound 150 30)
timeout "$t" python3 bench/kernels.py --tune --pairs --no-torch --iters 20 --confirm 2 \
  --shapes "$SHAPES" --commit "$(cat COMMIT 2>/dev/null || echo unknown)" \
  --table-out "$OUT/dispatch_h200.json" --json "$OUT/tune.json" >"$OUT/tune.log" 2>&1
note "# tune rc=$? (bound ${t} s) $(elapsed)"
# the new table's every launch shape on pair and SoA weights (bits, and the float64 reference)
cp kernels/cuda/dispatch_h200.json "$OUT/dispatch_committed.json"
[[ -s $OUT/dispatch_h200.json ]] && cp "$OUT/dispatch_h200.json" kernels/cuda/dispatch_h200.json
t=$(bound 45 2)
if ((t >= 15)); then
  timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
    tests/kernels/test_cuda_pairs.py -k "every_table_shape" >"$OUT/pytest_table.log" 2>&1
  note "# table-shape test rc=$? (bound ${t} s) $(elapsed)"
fi
echo "== k s13 call 1 (tree $(cat COMMIT 2>/dev/null || echo '?'))"
echo "table-shape test: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_table.log" 2>/dev/null | tail -1)"
grep -E '^(FAILED|ERROR|E  )' "$OUT/pytest_table.log" 2>/dev/null | head -5 | cut -c1-200
grep -E "^# (compiled|wrote)" "$OUT/tune.log"
echo "# changed cells re-timed (table us / tuned us, x = table/tuned; kept): $(grep -c ' confirm ' "$OUT/tune.log") lines"
grep -E " confirm +auto:" "$OUT/tune.log" | cut -c1-190
echo "# other columns kept tuned/table: $(grep -E ' confirm +(exact|f16|q8_1):' "$OUT/tune.log" | grep -c -- '-> tuned') / $(grep -E ' confirm +(exact|f16|q8_1):' "$OUT/tune.log" | grep -c -- '-> table')"
grep -c FAILED "$OUT/tune.log" | sed 's/^/# FAILED candidates: /'
echo "# goal 2: the new pair candidates' best vs the tune's best other candidate (us)"
python3 - "$OUT/tune.json" <<'PY' 2>&1 | tail -25
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
new = ("nt2.m1.w12.s5.pf", "nt2.m1.w16.s5.pf", "nt4.m1.w12.s5.pf", "nt2.m1.w12.s6.pf",
       "nt2.m1.w8.s6.pf")
cells = {}
for r in rows:
    if r.get("path") == "mma_f16" and r.get("us") is not None:
        cells.setdefault((r["shape"], r["n"]), []).append((r["us"], r["cfg"]))
for (shape, n), c in cells.items():
    nn = [x for x in c if x[1] in new]
    old = [x for x in c if x[1] not in new]
    if nn and old:
        a, b = min(nn), min(old)
        print(f"{shape:>12} {n:>3} new {a[1]} {a[0]:.1f} / best other {b[1]} {b[0]:.1f}: x{b[0] / a[0]:.3f}")
PY
(cd "$OUT" && tar czf "$FINAL/k_s13_logs.tgz" -- *)
cp "$OUT/dispatch_h200.json" "$FINAL/" 2>/dev/null
note "# done $(elapsed)"
