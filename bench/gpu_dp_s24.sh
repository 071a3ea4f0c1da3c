#!/usr/bin/env bash
# Session 24, issue 15 (dp), one script for the bundles (PHASE=a).
#  a (bound 70 s, bundle B): the lanes' pipe (Q6SERVE_DP_LANE_PIPE, on by default since this
#    session's bundle A won it over system regions). 1. T3's shape through lanes (8 hosts x 1
#    caller of N=64, bench/frontend_cpu.py --lane in a --frontends 2 worker) over CUDA IPC
#    regions (not measured in bundle A), pipe on / off alternated (LANE_RUNS, default c1 c0 c0
#    c1: c CUDA, s system; the digit: the switch, none: the default). 2. The
#    stretch target: one caller of N=1 through the lane, p50 - kernel, each stage stamped
#    (bench/lane_latency.py --stamps --check; LAT_RUNS, default f1: a one-process worker's
#    lane; f2: a --frontends 2 worker's). 3. T2 (64 callers of N=1, 6 front ends, round
#    robin) over system regions, the device process's stages timed (T2_RUNS, default s: what
#    bounds T2 over system regions, 13-17k rows/s against 24-27k over bytes in sessions
#    19-22's checks; b: bytes). 4. The GPU tests named in GPU_TESTS (default none).
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s24.sh   env: PHASE (a), BOUND, NEED (12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), LANE_RUNS, LAT_RUNS, T2_RUNS, GPU_TESTS
#                         (pytest's arguments), SECONDS_PER_RUN (1.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-70} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
gpu_tests() {  # gpu_tests LIMIT PATHS...: pytest -m gpu, each verdict as it ends
  local limit=$1
  shift
  (($#)) && left $((limit / 2)) || return 0
  timeout "$(bound "$limit" 2)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider "$@" \
    >"$OUT/pytest_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(grep -c " PASSED" "$OUT/pytest_gpu.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_gpu.log") failed) at $(elapsed)"
}
lane() {  # lane RUN NAME: T3's shape (8 hosts x 1 caller of N=64, one call in flight each)
  # through the fast lane (no gRPC a call), x and y in each caller's region: system (NAME s..)
  # or its CUDA IPC device buffer (c..), Q6SERVE_DP_LANE_PIPE = NAME's second letter (none:
  # the default); the lanes live in the device process of a --frontends 2 worker
  local region=system pipe=${2:1:1}
  [[ ${2:0:1} == c ]] && region=cuda
  Q6SERVE_DP_LANE_PIPE=${pipe:-${Q6SERVE_DP_LANE_PIPE:-}} timeout "$(bound 16 1)" python3 \
    bench/frontend_cpu.py --backend "$BACKEND" --rows $ROWS --k $K --n 64 --lane \
    --region "$region" --frontends 2 --hosts 8 --callers 1 --seconds "${SECONDS_PER_RUN:-1.0}" \
    --warmup 0.5 --json "$OUT/lane_$1.json" >"$OUT/lane_$1.log" 2>&1
  note "# $1 (T3's shape through the lane, $region, lane pipe ${pipe:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
latency() {  # latency RUN NAME: one caller N=1 through the lane (the stretch target), a worker
  # of NAME's digit front ends (1: one process), its stages stamped, y checked
  timeout "$(bound 16 1)" python3 bench/lane_latency.py --backend "$BACKEND" --rows $ROWS \
    --k $K --frontends "${2:1}" --paths lane --stamps --check --label "$1" \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --json "$OUT/lat_$1.json" \
    >"$OUT/lat_$1.log" 2>&1
  note "# $1 (one caller N=1 through the lane, --frontends ${2:1}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t2() {  # t2 RUN NAME: bench/service.py's T2 over system regions (NAME s..) or bytes (b..),
  # the device process's stages timed (Q6SERVE_DP_STATS)
  local kind=bytes
  [[ ${2:0:1} == s ]] && kind=system
  Q6SERVE_FRONTEND_ROUND_ROBIN=1 Q6SERVE_DP_STATS=$OUT/dpstats_t2_$1.jsonl \
    timeout "$(bound 14 1)" python3 bench/service.py --backend "$BACKEND" --dataplane \
    --modes stream --frontends 6 --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 \
    --targets T2 --regions "$kind" --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" \
    >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 $kind) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
case $PHASE in
  a)
    LANE_RUNS=${LANE_RUNS-c1 c0 c0 c1} LAT_RUNS=${LAT_RUNS-f1} T2_RUNS=${T2_RUNS-s}
    # shellcheck disable=SC2086  # (run names)
    [[ -n $LANE_RUNS ]] && ab_runs "${NEED:-12}" lane $LANE_RUNS
    # shellcheck disable=SC2086
    [[ -n $T2_RUNS ]] && ab_runs "${NEED:-12}" t2 $T2_RUNS
    # shellcheck disable=SC2086
    [[ -n $LAT_RUNS ]] && ab_runs "${NEED:-8}" latency $LAT_RUNS
    # shellcheck disable=SC2086  # (several paths)
    gpu_tests 20 ${GPU_TESTS-}
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE; gpu tests: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_gpu.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  for f in "$OUT"/lane_*.log; do
    if [[ -f $f ]]; then
      echo "# ${f##*/} $(grep -h -A1 "lane load" "$f" | cut -c1-300 | tr -s ' ')"
      grep -h "cpu (cores" "$f" | cut -c1-160 || true
    fi
  done
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  for f in "$OUT"/t2_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 -A1 "^T2 fe=" "$f" | cut -c1-150 | tr -s ' ')"
  done
  for f in "$OUT"/lat_*.log; do
    if [[ -f $f ]]; then
      echo "# ${f##*/}"
      grep -hE "^lane|p50 us:|check" "$f" | cut -c1-220
    fi
  done
  true  # (a log with no such line: the table still ends the script with status 0)
} | table
