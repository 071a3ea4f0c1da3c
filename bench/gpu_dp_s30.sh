#!/usr/bin/env bash
# Session 30, issue 15 (dp), one script for the bundles of session 31 (session 29's: `git show
# 0135cd5:bench/gpu_dp_s29.sh`, docs/SCALEOUT.md "Session 29").
# The question: one caller, N=1, ffn_down through the fast lane: is the ring's p99 above the
# socket's (bundle D of session 29: 126.5 against 97.5 us, 2 pairs; session 28's closing check
# the other way), and why. bench/lane_latency.py --rings on ONE worker, the two lanes (a ring
# one and a socket one, the same region size) alternated in pairs, each run y checked against
# the NumPy reference (--check), p50 / p99 / p99.9 / max, and per call the caller's and the
# worker's wake-ups (voluntary context switches: a thread that blocked; the worker's event loop
# thread apart) and preemptions, the caller's GC collections in the run.
#  a (bound 100 s): 1. LL_PAIRS pairs (default 4: sock ring ring sock x 2), LL_S s a run, the
#    caller's defaults (spin 1000 us on >= 8 cores): the answer (ring lower in how many pairs,
#    p50 / p99 / p99.9 medians a way). 2. 2 pairs stamped on both sides (--stamps, bench/
#    lane_stamps.py: each call's up / pre_job / job / post_job / down, and the slowest 1%'s
#    mean of each: WHICH part makes the ring's tail; on CPU, session 30, the ring's slowest 1%
#    was "down" and "up", the worker's reply to the caller's wake and back). 3. 2 pairs with
#    the caller's spin 5000 us (Q6SERVE_LANE_SPIN_US: does the caller's sleep path, flag + 20
#    us re-check + poll + doorbell, make the ring's tail?). 4. 2 pairs with the caller's GC off
#    (gc.freeze, gc.disable; on CPU no collection came near the tail). Read: wakes per call ~0
#    with the spin = the reply came within it; a ring tail that stays with no wakes is the
#    worker's side.
#  b (bound 100 s): 1. LL_PAIRS pairs with the caller pinned away from the worker
#    (--client-cpu CLIENT_CPU, --worker-cpus WORKER_CPUS: two spinning threads sharing a core or
#    its sibling?). 2. T3's shape through the lane on the caller's default (now the sealed-memfd
#    ring, f2601df) and over the socket (AB_T3R "ldef lsock:Q6SERVE_LANE_RING=0"): the ring's
#    new setup on the device, its rows/s against the socket's. 3. the hostile-lane tests
#    (tests/dataplane/test_lane_hostile.py: a shrinkable ring refused, an unread lane not read,
#    1,000 lanes leave nothing) on that host.
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s30.sh   env: PHASE (a), BOUND (95), NEED (12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), LL_PAIRS (4), LL_S (1.5), CLIENT_CPU (15),
#                         WORKER_CPUS (0-7), AB_T3R, T3_S (1), HOSTS (8)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
rings() {  # rings N: N pairs alternated, "sock,ring,ring,sock" each two
  local n=$1 out="" i
  for ((i = 0; i < n; i++)); do
    if ((i % 2 == 0)); then out+="sock,ring,"; else out+="ring,sock,"; fi
  done
  echo "${out%,}"
}
ll() {  # ll NAME PAIRS [ARGS...]: bench/lane_latency.py --rings on one worker, y checked
  local name=$1 pairs=$2 t=$SECONDS
  shift 2
  left "${NEED:-12}" || { note "# $name skipped at $(elapsed) (bound $BOUND s)"; return 0; }
  timeout "$(bound 60 2)" python3 bench/lane_latency.py --backend "$BACKEND" --rows $ROWS \
    --k $K --paths lane --check --rings "$(rings "$pairs")" --seconds "${LL_S:-1.5}" \
    --warmup 0.3 --label "$name" "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  note "# $name (lane_latency --rings, $pairs pairs $*) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
t3() {  # t3 RUN NAME: T3's shape through the lane (8 hosts x 1 caller of N=64, 2 front ends)
  local t=$SECONDS
  timeout "$(bound 30 1)" python3 bench/frontend_cpu.py \
    --backend "$BACKEND" --rows $ROWS --k $K --n 64 --lane --frontends 2 --hosts "${HOSTS:-8}" \
    --callers 1 --seconds "${T3_S:-1}" --warmup 0.5 --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T3 lane${Q6SERVE_LANE_RING:+, ring $Q6SERVE_LANE_RING}) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
case $PHASE in
  a)
    ll ll_pairs "${LL_PAIRS:-4}"
    ll ll_stamps 2 --stamps
    Q6SERVE_LANE_SPIN_US=5000 ll ll_spin5000 2
    ll ll_gcoff 2 --caller-gc off
    ;;
  b)
    ll ll_pinned "${LL_PAIRS:-4}" --client-cpu "${CLIENT_CPU:-15}" --worker-cpus "${WORKER_CPUS:-0-7}"
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-9}" t3 ${AB_T3R-ldef lsock:Q6SERVE_LANE_RING=0}
    step hostile 60 python3 -m pytest -q -p no:cacheprovider tests/dataplane/test_lane_hostile.py
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE"
  for f in "$OUT"/*.log; do
    case ${f##*/} in
      ll_*)
        echo "# ${f##*/}"
        grep -h -E "^lane |per call:|p50 us:|slowest 1%|^rings |check:" "$f" | cut -c1-230 |
          tr -s ' ' ;;
      ldef*|lsock*)
        echo "# ${f##*/}: $(grep -h -A1 "lane load" "$f" | cut -c1-260 | tr -s ' ')" ;;
      hostile*) echo "# ${f##*/}"; tail -3 "$f" ;;
    esac
  done
  true  # (no logs: the table still ends the script with status 0)
} | table
