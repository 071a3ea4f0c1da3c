#!/usr/bin/env bash
# Session 22, issue 15, bundle B (bound 60 s). 1. GPU_TESTS: the pinned arenas' GPU test (lone
# calls bit for bit against pageable arenas, 8 callers' merged batches gathered from their
# slots) and the gathered x's (CudaBackend.gathered / Launcher.launch_pieces bit for bit against
# the staged x). 2. TESTS on CUDA: what bundle A did not finish (test_raw_fuzz) or failed
# (test_pinned_regions' f16 tolerance, fixed). 3. T2 (64 callers of N=1, bytes, 6 front ends,
# round robin) with the arenas pinned and merged batches gathered (a1: Q6SERVE_DP_PIN_ARENA=1,
# Q6SERVE_DP_ARENA_GATHER on by default) against pageable arenas (a0), alternated (T2_RUNS,
# default a1 a0 a0 a1), the device process's stages on each. No run starts past BOUND - NEED
# s; a table last.
#   bench/gpu_dataplane_s22b.sh   env: BOUND (60), NEED (9), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), T2_RUNS, GPU_TESTS and
#                                 TESTS (pytest's arguments)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp22b
BOUND=${BOUND:-60} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
T=tests/dataplane
GPU_TESTS=${GPU_TESTS-$T/test_pinned_arena.py $T/test_arena_gather.py}
if [[ -n $GPU_TESTS ]] && left 30; then
  # shellcheck disable=SC2086  # (several paths)
  timeout "$(bound 22 4)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider $GPU_TESTS \
    >"$OUT/pytest_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_gpu.log")) at $(elapsed)"
fi
TESTS=${TESTS-$T/test_raw_fuzz.py \
$T/test_pinned_regions.py::test_one_process_pins_writes_y_in_place_and_releases}
if [[ -n $TESTS ]] && left 20; then
  # shellcheck disable=SC2086  # (TESTS: several paths)
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 14 2)" python3 -m pytest -v -rfE \
    -p no:cacheprovider $TESTS >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_dataplane_cuda.log") failed) at $(elapsed)"
fi
t2() {  # t2 RUN NAME: bench/service.py's T2 over bytes, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_t2_$1.jsonl timeout "$(bound 14 2)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T2 --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 bytes, arena pinned ${Q6SERVE_DP_PIN_ARENA:-0}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
runs=()
for v in ${T2_RUNS-a1 a0 a0 a1}; do runs+=("$v:Q6SERVE_DP_PIN_ARENA=${v#a}"); done
((${#runs[@]})) && ab_runs "${NEED:-9}" t2 "${runs[@]}"
{
  echo "# gpu tests: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_gpu.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 "^T2 fe=" "$f" | cut -c1-140)"
  done
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# $(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null) passed on $BACKEND"
} | table
