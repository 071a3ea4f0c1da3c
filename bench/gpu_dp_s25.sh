#!/usr/bin/env bash
# Session 25, issue 15 (dp), one script for the bundles (PHASE=b; bundle A's PHASE=a, T3 over
# system regions with Q6SERVE_DP_TICK_LEAN off / on, ran at 5f8c8df on branch dp-s25:
# `git show 5f8c8df:bench/gpu_dp_s25.sh`, docs/SCALEOUT.md "Session 25").
#  b (bound 75 s, bundle B): what bounds T3's shape on system regions, in the device process.
#    1. The closing check's LANE=1 lane row (T3's shape through the fast lane: 8 hosts x 1
#       caller of N=64 on ffn_down 3584x18944, a --frontends 2 worker, bench/frontend_cpu.py
#       --lane, as bench/gpu_dataplane_lane.sh runs it; bundle A: the device process at one
#       core, 0.457 of the kernel alone) with the launches in flight at once
#       (Q6SERVE_LAUNCH_SLOTS, default 3) alternated 3 / 4 (LANE_RUNS, default l3 l4 l4 l3: the
#       digit is the slots, none the default), the device process's stages timed
#       (Q6SERVE_DP_STATS, bench/device_stats_table.py --stages).
#    2. Profiles of the device process at the defaults (SPY_RUNS, default "lane t3"; runs of
#       SPY_RUN_S s): py-spy (1000 Hz, non-blocking, by function, SPY_S s) attached to it once
#       its counters show the load running, summarised by bench/spy_summary.py (its loop
#       thread: frames inclusive and as the leaf, then the loop's callbacks): the lane row, and
#       bench/service.py's T3 (8 hosts x 1 caller of N=64, 6 front ends round robin) over
#       system regions (bundle A: ~190 us of the device process's CPU a call).
#    3. The GPU tests named in GPU_TESTS (default none).
#  c (bound 60 s, bundle C: a confirmation): the lane row's slots alternated again (LANE_RUNS,
#    default l4 l3 l3 l4), T3 over system regions likewise (T3_RUNS, e.g. "s4 s3": the digit is
#    the slots; default none), then GPU_TESTS with Q6SERVE_LAUNCH_SLOTS=TEST_SLOTS.
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s25.sh   env: PHASE (b), BOUND, NEED (11), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), LANE_RUNS, SPY_RUNS, SPY_S (2, whole
#                         seconds), SPY_RUN_S (3.5), SPY (py-spy), SECONDS_PER_RUN (1.5),
#                         HOSTS (8), T3_RUNS, GPU_TESTS (pytest's arguments), TEST_SLOTS
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-b} BOUND=${BOUND:-75} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
SPY=${SPY:-/tmp/site/bin/py-spy}
[[ -x $SPY ]] || SPY=$(command -v py-spy || true)
gpu_tests() {  # gpu_tests LIMIT PATHS...: pytest -m gpu, each verdict as it ends
  local limit=$1
  shift
  (($#)) && left $((limit / 2)) || return 0
  timeout "$(bound "$limit" 2)" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider "$@" \
    >"$OUT/pytest_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(grep -c " PASSED" "$OUT/pytest_gpu.log") passed,\
 $(grep -c " FAILED" "$OUT/pytest_gpu.log") failed) at $(elapsed)"
}
lane_cmd() {  # lane_cmd STEM: the check's LANE=1 row (gpu_dataplane_lane.sh's F=2 C=1 J=1 P=0)
  Q6SERVE_JOB_BATCHES=1 Q6SERVE_PIPELINE_SHORT=0 Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl \
    timeout "$(bound 20 1)" python3 bench/frontend_cpu.py --backend "$BACKEND" --rows $ROWS \
    --k $K --n 64 --lane --frontends 2 --hosts "${HOSTS:-8}" --callers 1 \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.5 --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
}
lane() {  # lane RUN NAME: the lane row, Q6SERVE_LAUNCH_SLOTS = NAME's digit (none: default)
  local slots=${2:1:1}
  Q6SERVE_LAUNCH_SLOTS=${slots:-${Q6SERVE_LAUNCH_SLOTS:-}} lane_cmd "lane_$1"
  note "# lane_$1 (slots ${slots:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t3_cmd() {  # t3_cmd STEM: bench/service.py's T3 over system regions, 6 front ends round robin
  Q6SERVE_FRONTEND_ROUND_ROBIN=1 Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 16 1)" \
    python3 bench/service.py --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --t3-hosts "${HOSTS:-8}" --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T3 \
    --regions system --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
}
t3() {  # t3 RUN NAME: T3 over system regions, Q6SERVE_LAUNCH_SLOTS = NAME's digit (none: default)
  local slots=${2:1:1}
  Q6SERVE_LAUNCH_SLOTS=${slots:-${Q6SERVE_LAUNCH_SLOTS:-}} t3_cmd "t3_$1"
  note "# t3_$1 (slots ${slots:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
spy() {  # spy WHAT (lane, t3): WHAT's run at the defaults, its device process under py-spy
  # for SPY_S s once its counters (Q6SERVE_DP_STATS, a line a second) show the load's calls
  local what=$1 stem=spy_$1 pat='"batches": [1-9][0-9][0-9]' pid dev i
  [[ $what == t3 ]] && pat='"msg_rm": [1-9]'
  left 14 || { note "# $stem skipped at $(elapsed) (bound $BOUND s)"; return 0; }
  SECONDS_PER_RUN=${SPY_RUN_S:-3.5} "${what}_cmd" "$stem" &
  pid=$!
  for ((i = 0; i < 150; i++)); do  # (up to 15 s: the worker's start, the weight's upload)
    grep -q "$pat" "$OUT/dpstats_$stem.jsonl" 2>/dev/null && break
    sleep 0.1
  done
  dev=$(worker_pid 4)
  if [[ -n $SPY && -n $dev ]] && ((i < 150)); then
    timeout 20 "$SPY" record --pid "$dev" --duration "${SPY_S:-2}" --rate 1000 --nonblocking \
      --threads --function --format raw --output "$OUT/$stem.txt" >"$OUT/$stem.spylog" 2>&1
    note "# $stem py-spy rc=$? (pid $dev) at $(elapsed)"
  else
    note "# $stem: no profile (py-spy '${SPY:-none}', device process '${dev:-none}', load seen: \
$((i < 150)))"
  fi
  wait "$pid"
  note "# $stem rc=$? at $(elapsed)"
  if [[ -f $OUT/$stem.txt ]]; then  # the loop thread: frames, then the loop's callbacks
    timeout 20 python3 bench/spy_summary.py "$OUT/$stem.txt" --top 30 --thread MainThread \
      >"$OUT/$stem.summary" 2>&1
    timeout 20 python3 bench/spy_summary.py "$OUT/$stem.txt" --top 25 --thread MainThread \
      --under asyncio/events.py --depth 2 | sed -n '/^under/,$p' >>"$OUT/$stem.summary" 2>&1
  fi
  archive 2>/dev/null
}
case $PHASE in
  b)
    LANE_RUNS=${LANE_RUNS-l3 l4 l4 l3}
    # shellcheck disable=SC2086  # (run names)
    [[ -n $LANE_RUNS ]] && ab_runs "${NEED:-11}" lane $LANE_RUNS
    for w in ${SPY_RUNS-lane t3}; do spy "$w"; done
    # shellcheck disable=SC2086  # (several paths)
    gpu_tests 20 ${GPU_TESTS-}
    ;;
  c)
    LANE_RUNS=${LANE_RUNS-l4 l3 l3 l4}
    # shellcheck disable=SC2086  # (run names)
    [[ -n $LANE_RUNS ]] && ab_runs "${NEED:-11}" lane $LANE_RUNS
    T3_RUNS=${T3_RUNS-}
    # shellcheck disable=SC2086  # (run names)
    [[ -n $T3_RUNS ]] && ab_runs "${NEED:-11}" t3 $T3_RUNS
    # shellcheck disable=SC2086  # (several paths)
    Q6SERVE_LAUNCH_SLOTS=${TEST_SLOTS:-${Q6SERVE_LAUNCH_SLOTS:-}} gpu_tests 20 ${GPU_TESTS-}
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE; gpu tests: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null | cut -c1-120)"
  grep -E " (PASSED|FAILED|ERROR)" "$OUT/pytest_gpu.log" 2>/dev/null \
    | sed -E 's/^tests\/dataplane\///; s/ +\[ *[0-9]+%\]//' | cut -c1-110
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  for f in "$OUT"/t3_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 -A1 "^T3 fe=" "$f" | cut -c1-150 | tr -s ' ')"
  done
  for f in "$OUT"/lane_*.log "$OUT"/spy_lane.log; do
    [[ -f $f ]] || continue
    echo "# ${f##*/} $(grep -h -A1 "lane load" "$f" | cut -c1-300 | tr -s ' ')"
    grep -h "cpu (cores" "$f" | cut -c1-160 || true
  done
  f=$OUT/spy_t3.log
  [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 -A1 "^T3 fe=" "$f" | cut -c1-150 | tr -s ' ')"
  for f in "$OUT"/spy_*.summary; do
    [[ -f $f ]] && { echo "## ${f##*/}"; cut -c1-140 "$f"; }
  done
  true  # (a log with no such line: the table still ends the script with status 0)
} | table
