#!/usr/bin/env bash
# Session 22, issue 15, bundle A (bound 90 s). 1. The GPU test of page-locked front-end arenas
# (Q6SERVE_DP_PIN_ARENA: the device process cudaHostRegisters each front end's arena, so an x
# in its slot is DMA'd from there, no staging copy, and a full call's y is DMA'd into its slot;
# y bit for bit against pageable arenas). 2. T3 through gRPC bytes (8 hosts of N=64 on
# ffn_down, 6 front ends round robin) with the arenas pinned / not, alternated (a1 a0 a0 a1).
# 3. TESTS on the CUDA backend (the data-plane tests that never ran there), at most 30 s.
# 4. T2 (64 callers of N=1, bytes) a1 a0 with what is left (a lone call's x is DMA'd by
# launch_host when pinned). The device process's stages on every run. No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s22a.sh   env: BOUND (90), NEED (9), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), T3_RUNS, T2_RUNS,
#                                 TESTS (pytest's arguments)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp22a
BOUND=${BOUND:-90} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 40; then
  timeout "$(bound 20 4)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider \
    tests/dataplane/test_pinned_arena.py >"$OUT/pytest_arena.log" 2>&1
  note "# arena gpu test rc=$? ($(tail -1 "$OUT/pytest_arena.log")) at $(elapsed)"
fi
run() {  # run TARGET RUN NAME: bench/service.py's TARGET over bytes, the device process's stages
  local t=$1 run=$2
  Q6SERVE_DP_STATS=$OUT/dpstats_${t,,}_$run.jsonl timeout "$(bound 16 2)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets "$t" --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/${t,,}_$run.json" >"$OUT/${t,,}_$run.log" 2>&1
  note "# $run ($t bytes, arena pinned ${Q6SERVE_DP_PIN_ARENA:-0}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t3() { run T3 "$@"; }
t2() { run T2 "$@"; }
variants() {  # variants FN RUNS: ab_runs over RUNS' names (aN: Q6SERVE_DP_PIN_ARENA=N)
  local v out=()
  for v in $2; do out+=("$v:Q6SERVE_DP_PIN_ARENA=${v#a}"); done
  ((${#out[@]})) && ab_runs "${NEED:-9}" "$1" "${out[@]}"
}
variants t3 "${T3_RUNS-a1 a0 a0 a1}"
T=tests/dataplane
TESTS=${TESTS-$T/test_device_direct.py $T/test_pinned_regions.py $T/test_job_batches.py \
$T/test_lane_spin.py $T/test_raw_fuzz.py}
if [[ -n $TESTS ]] && left 12; then  # (-v: each verdict as it ends, so a cut run says which)
  # shellcheck disable=SC2086  # (TESTS: several paths)
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 30 2)" python3 -m pytest -v -rfE \
    -p no:cacheprovider $TESTS >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_dataplane_cuda.log") failed) at $(elapsed)"
fi
variants t2 "${T2_RUNS-a1 a0}"
{
  echo "# arena gpu test: $(tail -1 "$OUT/pytest_arena.log" 2>/dev/null | cut -c1-120)"
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair a0:a1:"bytes, arena pinned 0 / 1" 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 "^T2 fe=" "$f" | cut -c1-140)"
  done
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | cut -c1-120)"
  grep -E " (FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# $(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null) passed on $BACKEND"
} | table
