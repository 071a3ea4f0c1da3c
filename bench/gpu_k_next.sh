#!/usr/bin/env bash
# The pair-stream layout's first H200 call (branch k-pairs; docs/KERNELS.md "A decode from a
# resident repack", its "Next call" note). Sized for <= 240 s of device time with the cold start
# (~40 s) and the idle tail (~30 s): this command's own wall is bounded by CALL_S (165 s), each
# step by what is left of it, in the order of what the call decides:
#   1. tests/kernels/test_cuda_pairs.py (-m gpu): every path on a pair-stream weight bit-identical
#      to the SoA weight, read-back/relayout exact (~30 names compiled in parallel programs of two);
#   2. the product-path A/B: bench/kernels.py AUTO f16 on the five shapes at N = 1/8/16/32/64
#      without, with and again without Q6SERVE_Q6K_PAIRS=1 (the repeat bounds the drift; AUTO's
#      names compiled up front, bench/kernels.py prefetch_auto);
#   3. `tests/kernels -m gpu -k "ks or wg"` (the K-slice and wgmma tiles, whose templates now take
#      the int layout code) with whatever is left (at least 30 s, else skipped and said so).
# Then a short table: the tests' summary lines, off vs on and off vs off2 per cell.
# Send: the TEAM.md recipe with NAME=k, then
#   run(carry=[".gpu/k", ".whl"], command="cd .gpu/k && ln -sfn ../../.whl .whl && bash bench/gpu_k_next.sh", timeout_s=200)
# CPU rehearsal (no GPU: the tests skip, the bench runs fail at once, the steps and bounds show):
#   DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_next.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/knext
CALL_S=${CALL_S:-165}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }  # min(cap, left - reserve)
note "# setup done $(elapsed)"

t=$(bound "${PAIRS_TIMEOUT:-50}")
timeout "$t" python3 -m pytest -m gpu -q -rfE --durations=5 -p no:cacheprovider \
  tests/kernels/test_cuda_pairs.py >"$OUT/pytest_pairs.log" 2>&1
note "# pairs tests rc=$? (bound ${t} s) $(elapsed)"

ABARGS=(--paths auto --dtypes f16 --no-torch --ns 1,8,16,32,64
        --shapes 4096x14336,14336x4096,18944x3584,3584x18944,152064x3584)
declare -A RESERVE=([off]=45 [on]=5 [off2]=35)  # off leaves on its 40 s; off2 leaves ks/wg 30
for v in off on off2; do
  t=$(bound "${AB_TIMEOUT:-40}" "${RESERVE[$v]}")
  if ((t < 15)); then note "# envab $v skipped: ${t} s left for it"; continue; fi
  ( [[ $v == on ]] && export Q6SERVE_Q6K_PAIRS=1
    timeout "$t" python3 bench/kernels.py "${ABARGS[@]}" --json "$OUT/envab_$v.json" \
      >"$OUT/envab_$v.log" 2>&1 )
  note "# envab $v rc=$? (bound ${t} s) $(elapsed)"
done

t=$(bound "${KSWG_TIMEOUT:-90}" 8)
if ((t >= 30)); then
  timeout "$t" python3 -m pytest -m gpu -q -rfE --durations=5 -p no:cacheprovider \
    tests/kernels -k "(ks or wg) and not pairs" >"$OUT/pytest_kswg.log" 2>&1
  note "# ks/wg tests rc=$? (bound ${t} s) $(elapsed)"
else
  note "# ks/wg tests skipped: ${t} s left"
fi

echo "== summary (tree $(cat COMMIT 2>/dev/null || echo '?'))"
for f in pytest_pairs pytest_kswg; do
  [[ -f $OUT/$f.log ]] && echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" | tail -1)"
  [[ -f $OUT/$f.log ]] && grep -E '^(FAILED|ERROR) ' "$OUT/$f.log" | head -5 | cut -c1-200
done
grep -h "# compiled" "$OUT"/envab_*.log 2>/dev/null
for v in on off2; do
  [[ -f $OUT/envab_off.json && -f $OUT/envab_$v.json ]] || continue
  python3 bench/kernels_ab.py "$OUT/envab_off.json" "$OUT/envab_$v.json" --label-old off --label-new "$v"
done | tee "$OUT/envab.txt"
(cd "$OUT" && tar czf "$FINAL/k_next_logs.tgz" -- *)
note "# done $(elapsed)"
