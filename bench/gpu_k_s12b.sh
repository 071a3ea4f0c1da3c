#!/usr/bin/env bash
# Session 12's second own call of k (branch k-pairs), before the pair-stream layout goes on by
# default. The command's wall is bounded by CALL_S (115 s; ~205 s of device time with the cold
# start and the idle tail), each step by what is left of it:
#   1. bench/pair_bits.py: the one cell whose bits differed in call 1 (152064x3584 N=16, the
#      K-slice tile nt2.w12) and its neighbours, three runs each on SoA and on pair streams, PDL
#      on and off: the kernel's own repeat-determinism vs the layout's;
#   2. tests/kernels/test_cuda_pairs.py again (the f16 tile's two m-tiles at 8 warps now run as
#      one m-tile on twice the CTAs on pair weights: a new case in test_other_paths_and_dtypes);
#   3. test_cuda_backend.py's layout, slab, relayout, determinism, graph and half-activation
#      tests with Q6SERVE_Q6K_PAIRS=1 (what the default flip changes for them: every SoA weight
#      a pair-stream weight, f32 activations included);
#   4. bench/kernels.py --tune --pairs on three shapes (the table's picks timed on pair weights
#      beside every candidate: the re-check of the table for the pair layout), table to $OUT.
# Send: the TEAM.md recipe with NAME=k, then
#   run(carry=[".gpu/k", ".whl"], command="cd .gpu/k && ln -sfn ../../.whl .whl && bash bench/gpu_k_s12b.sh", timeout_s=122)
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s12b.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks12b
CALL_S=${CALL_S:-115}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
note "# setup done $(elapsed)"

t=$(bound 25 85)
timeout "$t" python3 bench/pair_bits.py --json "$OUT/pair_bits.json" >"$OUT/pair_bits.log" 2>&1
note "# pair_bits rc=$? (bound ${t} s) $(elapsed)"

t=$(bound 25 65)
timeout "$t" python3 -m pytest -m gpu -q -rfE --durations=3 -p no:cacheprovider \
  tests/kernels/test_cuda_pairs.py >"$OUT/pytest_pairs.log" 2>&1
note "# pairs tests rc=$? (bound ${t} s) $(elapsed)"

t=$(bound 30 35)
Q6SERVE_Q6K_PAIRS=1 timeout "$t" python3 -m pytest -m gpu -q -rfE --durations=3 \
  -p no:cacheprovider tests/kernels/test_cuda_backend.py \
  -k "bit_identical or multi_slab or relayout or deterministic or graphs or half_act or peak_vram" \
  >"$OUT/pytest_backend_pairs.log" 2>&1
note "# backend tests on pair weights rc=$? (bound ${t} s) $(elapsed)"

t=$(bound 60 3)
if ((t >= 15)); then
  timeout "$t" python3 bench/kernels.py --tune --pairs --no-torch --iters 30 \
    --shapes 3584x18944,4096x14336,152064x3584 --table-out "$OUT/pairs_table.json" \
    --json "$OUT/pairs_tune.json" >"$OUT/pairs_tune.log" 2>&1
  note "# tune --pairs rc=$? (bound ${t} s) $(elapsed)"
fi

echo "== summary (tree $(cat COMMIT 2>/dev/null || echo '?'))"
cat "$OUT/pair_bits.log" 2>/dev/null | tail -30
for f in pytest_pairs pytest_backend_pairs; do
  [[ -f $OUT/$f.log ]] || continue
  echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/$f.log" | head -5 | cut -c1-200
done
grep -E "^#|on pairs" "$OUT/pairs_tune.log" 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/k_s12b_logs.tgz" -- *)
note "# done $(elapsed)"
