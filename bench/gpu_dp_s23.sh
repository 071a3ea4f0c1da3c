#!/usr/bin/env bash
# Session 23, issue 15 (dp), one script for bundles A-C (PHASE=a|b|c).
#  a (bound 75 s; bundle A ran it at 52fbe80): the merged pipe (Q6SERVE_DP_MERGED_PIPE: the
#    device process launched a trip's plain bytes batches, merged or lone, behind the launches
#    out and answered them a loop trip later, not inline). 1. Its GPU test (8 callers through 2
#    front ends, y against one caller's inline y). 2. T2 (64 callers of N=1, bytes, 6 front
#    ends, round robin) pipe on / off alternated (T2_RUNS, default m1 m0 m0 m1), the device
#    process's stages on every run. It lost (docs/SCALEOUT.md, session 23): the switch and its
#    test are gone from this tree (branch dp-merged-pipe-s23 keeps them), so here phase a runs
#    T2 alone.
#  b (bound 70 s): the lanes' pipe (Q6SERVE_DP_LANE_PIPE: a --frontends worker's fast lanes
#    launch their full batches through the device process's pipeline, answered a loop trip
#    later, not waited for inline in the lane's flush). 1. The lanes' GPU tests with it on. 2.
#    T3's shape through lanes (8 hosts x 1 caller of N=64; LANE_RUNS, default s1 s0 s0 s1 c1
#    c0: pipe on / off alternated, s: system regions, c: CUDA IPC regions). T3_RUNS / T2_RUNS: bench/
#    service.py's T3 (s: system, c: cuda, b: bytes) and T2 (mN) runs after them (default none).
#  c (bound 60 s): at the tree to land. 1. The lanes' GPU tests at the defaults. 2. T3's shape
#    through lanes (LANE_RUNS, default s c s0: system and CUDA regions at the defaults, system
#    with the lanes' pipe off). 3. T2's timeline (bench/t2_timeline.py, TIMELINE=: none).
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s23.sh   env: PHASE (a), BOUND, NEED (12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1, ROW_SCALE), T2_RUNS, LANE_RUNS, T3_RUNS,
#                         GPU_TESTS (pytest's arguments; empty: none), SECONDS_PER_RUN
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-75} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
T=tests/dataplane
gpu_tests() {  # gpu_tests LIMIT PATHS...: pytest -m gpu, each verdict as it ends
  local limit=$1
  shift
  (($#)) && left $((limit / 2)) || return 0
  timeout "$(bound "$limit" 2)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider "$@" \
    >"$OUT/pytest_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(grep -c " PASSED" "$OUT/pytest_gpu.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_gpu.log") failed) at $(elapsed)"
}
t2() {  # t2 RUN NAME: bench/service.py's T2 over bytes, the device process's stages
  Q6SERVE_DP_STATS=$OUT/dpstats_t2_$1.jsonl timeout "$(bound 14 1)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T2 --regions bytes \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t2_$1.json" >"$OUT/t2_$1.log" 2>&1
  note "# $1 (T2 bytes, merged pipe ${Q6SERVE_DP_MERGED_PIPE:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t3() {  # t3 RUN NAME: bench/service.py's T3 (8 hosts of N=64) over the regions of NAME's
  # first letter (s: system, c: cuda, b: bytes), the device process's stages
  local kind
  case ${2:0:1} in s) kind=system ;; c) kind=cuda ;; *) kind=bytes ;; esac
  Q6SERVE_DP_STATS=$OUT/dpstats_t3_$1.jsonl timeout "$(bound 16 1)" python3 bench/service.py \
    --backend "$BACKEND" --dataplane --modes stream --frontends 6 --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.0}" --warmup 0.3 --targets T3 --regions "$kind" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 $kind) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
lane() {  # lane RUN NAME: T3's shape (8 hosts x 1 caller of N=64, one call in flight each)
  # through the fast lane (no gRPC a call), x and y in each caller's region: system (NAME s..)
  # or its CUDA IPC device buffer (c..), Q6SERVE_DP_LANE_PIPE = NAME's second letter (none:
  # the default); bench/frontend_cpu.py --lane on a --frontends 2 worker (the lanes live in
  # its device process)
  local region=system rows=3584 k=18944 pipe=${2:1:1}
  [[ ${2:0:1} == c ]] && region=cuda
  [[ $BACKEND == numpy ]] && rows=256 k=3584
  Q6SERVE_DP_LANE_PIPE=${pipe:-${Q6SERVE_DP_LANE_PIPE:-}} timeout "$(bound 16 1)" python3 \
    bench/frontend_cpu.py --backend "$BACKEND" --rows $rows --k $k --n 64 --lane \
    --region "$region" --frontends 2 --hosts 8 --callers 1 --seconds "${SECONDS_PER_RUN:-1.0}" \
    --warmup 0.5 --json "$OUT/lane_$1.json" >"$OUT/lane_$1.log" 2>&1
  note "# $1 (T3's shape through the lane, $region, lane pipe ${pipe:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
timeline() {  # timeline RUN: bench/t2_timeline.py, T2 at 6 front ends (8 load processes of
  # 8 callers), each call cut into parts at p50 and over the slowest 1% (what makes p99)
  local rows=3584 k=18944
  [[ $BACKEND == numpy ]] && rows=256 k=3584
  Q6SERVE_DP_STATS=$OUT/dpstats_tl_$1.jsonl timeout "$(bound 18 1)" python3 bench/t2_timeline.py \
    --backend "$BACKEND" --rows $rows --k $k --frontends 6 --hosts 8 --callers 8 \
    --seconds "${TIMELINE_SECONDS:-2}" --warmup 0.5 --json "$OUT/tl_$1.json" \
    >"$OUT/tl_$1.log" 2>&1
  note "# $1 (T2's timeline) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
variants() {  # variants FN RUNS: ab_runs over RUNS' names (mN: Q6SERVE_DP_MERGED_PIPE=N)
  local v out=()
  for v in $2; do out+=("$v:Q6SERVE_DP_MERGED_PIPE=${v#m}"); done
  ((${#out[@]})) && ab_runs "${NEED:-12}" "$1" "${out[@]}"
}
case $PHASE in
  a)
    # shellcheck disable=SC2086  # (several paths)
    gpu_tests 16 ${GPU_TESTS-}
    variants t2 "${T2_RUNS-m1 m0 m0 m1}"
    ;;
  b)
    # the lanes' GPU tests with their full batches through the device process's pipeline
    # shellcheck disable=SC2086  # (several paths)
    Q6SERVE_DP_LANE_PIPE=1 gpu_tests 22 ${GPU_TESTS-$T/test_pinned_gpu.py \
      $T/test_cuda_ipc_gpu.py -k lane}
    LANE_RUNS=${LANE_RUNS-s1 s0 s0 s1 c1 c0} T3_RUNS=${T3_RUNS-}
    # shellcheck disable=SC2086  # (run names)
    [[ -n $LANE_RUNS ]] && ab_runs "${NEED:-12}" lane $LANE_RUNS
    # shellcheck disable=SC2086
    [[ -n $T3_RUNS ]] && ab_runs "${NEED:-12}" t3 $T3_RUNS
    variants t2 "${T2_RUNS-}"
    ;;
  c)
    # shellcheck disable=SC2086  # (several paths)
    gpu_tests 22 ${GPU_TESTS-$T/test_pinned_gpu.py $T/test_cuda_ipc_gpu.py -k lane}
    LANE_RUNS=${LANE_RUNS-s c s0}
    # shellcheck disable=SC2086  # (run names)
    [[ -n $LANE_RUNS ]] && ab_runs "${NEED:-12}" lane $LANE_RUNS
    [[ -n ${TIMELINE-1} ]] && left 16 && timeline t
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE; gpu tests: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_gpu.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  for f in "$OUT"/t2_*.log "$OUT"/t3_*.log; do
    if [[ -f $f ]]; then
      echo "# ${f##*/} $(grep -h -m1 -A1 "^T[23] fe=" "$f" | cut -c1-150 | tr -s ' ')"
    fi
  done
  for f in "$OUT"/tl_*.log; do
    if [[ -f $f ]]; then
      echo "# ${f##*/}"
      grep -v "^#" "$f" | tail -16 | cut -c1-200
    fi
  done
  for f in "$OUT"/lane_*.log; do
    if [[ -f $f ]]; then
      echo "# ${f##*/} $(grep -h -A1 "lane load" "$f" | cut -c1-300 | tr -s ' ')"
    fi
  done
} | table
