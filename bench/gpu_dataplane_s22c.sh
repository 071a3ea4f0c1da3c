#!/usr/bin/env bash
# Session 22, issue 15, bundle C (bound 60 s), at the tree to land (pinned arenas and gathered
# merged batches on by default). 1. Every data-plane GPU test (`pytest -m gpu tests/dataplane`:
# the closing check's dataplane_gpu suite, now with the pinned arenas' and gathered x's tests,
# and the region tests that count only their own pins). 2. With what is left, T2 (64 callers of
# N=1, bytes, 6 front ends, round robin) at the defaults (a1) and with pageable arenas (a0),
# alternated (T2_RUNS, default a1 a0), the device process's stages on each. A table last.
#   bench/gpu_dataplane_s22c.sh   env: BOUND (60), NEED (9), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE), T2_RUNS, GPU_TESTS
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp22c
BOUND=${BOUND:-60} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
GPU_TESTS=${GPU_TESTS-tests/dataplane}
if [[ -n $GPU_TESTS ]] && left 20; then
  # shellcheck disable=SC2086  # (several paths)
  timeout "$(bound 44 2)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider $GPU_TESTS \
    >"$OUT/pytest_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(grep -c " PASSED" "$OUT/pytest_gpu.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_gpu.log") failed) at $(elapsed)"
fi
t2() {  # t2 RUN NAME: bench/service.py's T2 over bytes, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_t2_$1.jsonl timeout "$(bound 12 1)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T2 --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 bytes, arena pinned ${Q6SERVE_DP_PIN_ARENA:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
runs=()
for v in ${T2_RUNS-a1 a0}; do
  if [[ $v == a1 ]]; then runs+=("a1"); else runs+=("$v:Q6SERVE_DP_PIN_ARENA=${v#a}"); fi
done
((${#runs[@]})) && ab_runs "${NEED:-9}" t2 "${runs[@]}"
{
  echo "# gpu tests: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null | cut -c1-120)"
  grep -E " (FAILED|ERROR)" "$OUT/pytest_gpu.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 "^T2 fe=" "$f" | cut -c1-140)"
  done
  echo "# $(grep -c " PASSED" "$OUT/pytest_gpu.log" 2>/dev/null) gpu tests passed"
} | table
