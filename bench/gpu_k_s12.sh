#!/usr/bin/env bash
# Session 12's first own call of k (branch k-pairs): does the pair-stream layout go on by default?
# The command's wall is bounded by CALL_S (170 s; ~260 s of device time with the cold start and
# the idle tail), each step by what is left of it, in the order of what the call decides:
#   1. tests/kernels/test_cuda_pairs.py (-m gpu): every path on a pair-stream weight bit-identical
#      to the SoA weight (now with the ring tile's pair form and the f16 tile's two m-tiles run as
#      one m-tile at twice the warps), read-back/relayout exact; a test past 40 s dumps its
#      threads (faulthandler) so a stall names its line;
#   2. bench/kernels.py --pairs-ab: AUTO (the committed table) on SoA and on pair-stream copies
#      of the same blocks, alternated in one process, bits compared, torch f16 beside: the ten
#      model shapes at N = 1..64 (the 48-56 MB shapes and the lm-heads first);
#   3. test_cuda_backend.py's launch-variant test (every K-slice and ring shape on SoA and AoS:
#      the ring template now takes the int layout code) with what is left (>= 25 s).
# Send: the TEAM.md recipe with NAME=k, then
#   run(carry=[".gpu/k", ".whl"], command="cd .gpu/k && ln -sfn ../../.whl .whl && bash bench/gpu_k_s12.sh", timeout_s=185)
# CPU rehearsal (the tests skip, the bench fails at once):
#   DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s12.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks12
CALL_S=${CALL_S:-170}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
note "# setup done $(elapsed)"

t=$(bound 70 60)
timeout "$t" python3 -m pytest -m gpu -q -rfE --durations=0 -p no:cacheprovider \
  -o faulthandler_timeout=40 tests/kernels/test_cuda_pairs.py >"$OUT/pytest_pairs.log" 2>&1
note "# pairs tests rc=$? (bound ${t} s) $(elapsed)"

SHAPES=4096x14336,14336x4096,18944x3584,3584x18944,152064x3584,128256x4096,4096x4096,3584x3584
SHAPES+=,1024x4096,512x3584
t=$(bound 95 25)
timeout "$t" python3 bench/kernels.py --pairs-ab --shapes "$SHAPES" --ns 1,2,4,8,16,32,64 \
  --json "$OUT/pairs_ab.json" >"$OUT/pairs_ab.log" 2>&1
note "# pairs-ab rc=$? (bound ${t} s) $(elapsed)"

t=$(bound 60 3)
if ((t >= 25)); then
  timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/kernels/test_cuda_backend.py -k "every_launch_variant" >"$OUT/pytest_variants.log" 2>&1
  note "# variant test rc=$? (bound ${t} s) $(elapsed)"
else
  note "# variant test skipped: ${t} s left"
fi

echo "== summary (tree $(cat COMMIT 2>/dev/null || echo '?'))"
for f in pytest_pairs pytest_variants; do
  [[ -f $OUT/$f.log ]] || continue
  echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/$f.log" | head -5 | cut -c1-200
done
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ |^#" "$OUT/pairs_ab.log" 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/k_s12_logs.tgz" -- *)
note "# done $(elapsed)"
