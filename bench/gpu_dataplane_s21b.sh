#!/usr/bin/env bash
# Session 21, issue 15, bundle B (bound 60 s). 1. GPU_TESTS (default: the place graphs' GPU test
# with the device process's place_launches counter fixed) at the tree to land. 2. TESTS on CUDA (cut
# to leave 20 s). 3. T2 (64 callers of N=1, bytes, round robin, as the closing check runs it) at
# 6 front ends (T2_RUNS: fN runs at N front ends), the device process's stages with the merged
# batch cut in three (x staged, the inline job, the answers). 4. T3 over CUDA regions, place
# graphs on / off (T3_RUNS, default "p1 p0"), with what is left. No run starts past
# BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s21b.sh   env: BOUND (57), NEED (9), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), T3_RUNS, T2_RUNS,
#                                 GPU_TESTS (pytest -k expression), TESTS (pytest's arguments;
#                                 default: test_frontends.py but the 5 bundle A passed on CUDA)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp21b
BOUND=${BOUND:-57} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if [[ -n ${GPU_TESTS-x} ]] && left 40; then
  timeout "$(bound 20 4)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider \
    tests/dataplane/test_cuda_ipc_gpu.py -k "${GPU_TESTS:-place_graphs}" \
    >"$OUT/pytest_place.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_place.log")) at $(elapsed)"
fi
# test_frontends.py's tests that bundle A did not reach on CUDA (its 5 first passed there)
F=tests/dataplane/test_frontends.py
TESTS=${TESTS-$F --deselect $F::test_every_frontend_serves_the_whole_contract --deselect \
$F::test_frontend_killed_mid_call --deselect $F::test_drain_finishes_in_flight_calls --deselect \
$F::test_worker_command_with_frontends --deselect $F::test_multi_weight_and_topk_through_frontends}
if [[ -n $TESTS ]] && left 20; then
  # shellcheck disable=SC2086  # (TESTS: several paths)
  Q6SERVE_TEST_BACKEND=$BACKEND timeout "$(bound 30 20)" python3 -m pytest -v -rfE \
    -p no:cacheprovider $TESTS >"$OUT/pytest_dataplane_cuda.log" 2>&1
  note "# tests on $BACKEND rc=$? ($(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_dataplane_cuda.log") failed) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over CUDA regions, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 20 2)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions cuda \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 cuda, place graphs ${Q6SERVE_DP_PLACE_GRAPH:-1}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t2() {  # t2 RUN NAME: bench/service.py's T2 (bytes) at $FRONTENDS front ends, with the stages
  Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 20 2)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends "${FRONTENDS:-6}" \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T2 --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 bytes, ${FRONTENDS:-6} front ends) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
variants() {  # variants FN RUNS: ab_runs over RUNS' names (pN: place graphs N, fN: N front ends)
  local v out=()
  for v in $2; do
    case $v in
      p*) out+=("$v:Q6SERVE_DP_PLACE_GRAPH=${v#p}") ;;
      f*) out+=("$v:FRONTENDS=${v#f}") ;;
    esac
  done
  ((${#out[@]})) && ab_runs "${NEED:-9}" "$1" "${out[@]}"
}
variants t2 "${T2_RUNS-f6}"
variants t3 "${T3_RUNS-p1 p0}"
{
  echo "# gpu tests: $(tail -1 "$OUT/pytest_place.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_place.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  python3 bench/t3_ab_table.py "$OUT" --pair p0:p1:"cuda, place graphs 0 / 1" 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h "^T2 fe=" "$f" | cut -c1-140)"
  done
  echo "# tests on $BACKEND: $(tail -1 "$OUT/pytest_dataplane_cuda.log" 2>/dev/null | cut -c1-120)"
  grep -E " (FAILED|ERROR)" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# $(grep -c " PASSED" "$OUT/pytest_dataplane_cuda.log" 2>/dev/null) passed on $BACKEND"
} | table
