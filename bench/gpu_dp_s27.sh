#!/usr/bin/env bash
# Session 27, issue 15 (dp), one script for the bundles (session 26's T2 timeline and lane row:
# `git show 6fb1383:bench/gpu_dp_s26.sh`, docs/SCALEOUT.md "Session 26").
#  a (bound 100 s, bundle A): GPU tests of the change first (test_pinned_gpu.py's merged small
#    region calls, GPUTEST=0: not), then the merged start of system-region calls, this tree against main
#    6fb1383 (service/frontends.py only: bench/dp_s27/frontends_6fb1383.py.txt, main's file,
#    on a PYTHONPATH overlay of this tree: ab_runs' "base" variants), then the lane latency.
#    1. lat: bench/lane_latency.py (one caller of N=1 on ffn_down, gRPC bytes and the fast
#       lane, y checked), as gpu_check.sh's lane_latency step, --seconds 1: its figure (p50 -
#       kernel <= 50 us) and its wall time (the check cut it at 5 s in session 26).
#    2. T2 over system regions (bench/service.py --dataplane --targets T2 --regions system: 64
#       callers of N=1, 6 front ends round robin, one run of T2_S s) alternated AB (new base
#       base new), the device process's counters and stage timers on (Q6SERVE_DP_STATS,
#       bench/device_stats_table.py --stages).
#  b (bound 100 s, bundle B): the GPU tests; the lane latency with its stamped parts (--stamps);
#    T2 over system regions alternated AB_B (new base base new new base); then T2 over gRPC
#    bytes AB_BYTES (bytesnew basebytes: the bytes path's merged start is shared code).
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s27.sh   env: PHASE (a), BOUND (95), NEED (18; b: 12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), AB (new base base new), T2_S (1.5),
#                         REGIONS (system), LAT (1: the lane latency first; 0: not), GPUTEST (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
# the base: this tree's source folders, service/ a copy with main's frontends.py
mkdir -p /tmp/dp_base
for d in kernels client proto; do ln -sfn "$PWD/$d" "/tmp/dp_base/$d"; done
rm -rf /tmp/dp_base/service && cp -r service /tmp/dp_base/service
# (main's frontends.py copy lives on branch wt-dp only: a copy of a product file stays off main)
if [[ -f bench/dp_s27/frontends_6fb1383.py.txt ]]; then
  cp bench/dp_s27/frontends_6fb1383.py.txt /tmp/dp_base/service/frontends.py
else
  echo "# no bench/dp_s27/frontends_6fb1383.py.txt: base and new run the same frontends.py"
fi
base_tree /tmp/dp_base
lat() {  # lat: bench/lane_latency.py as gpu_check.sh's lane_latency step, shorter
  local t=$SECONDS
  timeout "$(bound 40 1)" python3 bench/lane_latency.py --backend "$BACKEND" --rows $ROWS \
    --k $K --paths grpc,lane --check --seconds 1 --warmup 0.2 --json "$OUT/lat.json" \
    ${LAT_ARGS:-} >"$OUT/lat.log" 2>&1
  note "# lat (lane latency) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
gputest() {  # gputest: the GPU tests of the merged system-region calls (and the region DMA)
  local t=$SECONDS
  timeout "$(bound 25 1)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_pinned_gpu.py -k "small_region_calls or x_and_y_dma" \
    >"$OUT/gputest.log" 2>&1
  note "# gputest rc=$? in $((SECONDS - t)) s ($(tail -1 "$OUT/gputest.log")) at $(elapsed)"
}
t2() {  # t2 RUN NAME: T2 over REGIONS through 6 front ends round robin, the stage timers on
  local t=$SECONDS
  Q6SERVE_FRONTEND_ROUND_ROBIN=1 Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 40 1)" \
    python3 bench/service.py --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --t3-hosts 8 --seconds "${T2_S:-1.5}" --warmup 0.3 --targets T2 --regions "${REGIONS:-system}" \
    --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T2 ${REGIONS:-system}) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
case $PHASE in
  a)
    [[ ${GPUTEST:-1} != 0 ]] && gputest
    [[ ${LAT:-1} != 0 ]] && lat
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-18}" t2 ${AB-new base base new}
    ;;
  b)
    [[ ${GPUTEST:-1} != 0 ]] && gputest
    [[ ${LAT:-1} != 0 ]] && LAT_ARGS="--stamps" lat
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" t2 ${AB_B-new base base new new base}
    # shellcheck disable=SC2086  # (run names; t2's runs over gRPC bytes)
    REGIONS=bytes ab_runs "${NEED:-12}" t2 ${AB_BYTES-bytesnew basebytes}
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE"
  [[ -f $OUT/gputest.log ]] && grep -E "passed|failed|error" "$OUT/gputest.log" | tail -3
  [[ -f $OUT/lat.log ]] && grep -E -A1 "^lane|^grpc|check:" "$OUT/lat.log" | cut -c1-220
  for f in "$OUT"/new_*.log "$OUT"/base_*.log "$OUT"/bytesnew_*.log "$OUT"/basebytes_*.log; do
    [[ -f $f ]] && { echo "# ${f##*/} $(grep -h -E "^# T2 " "$f" | cut -c1-200 | tr -s ' ')"; grep -h "^T2 fe=" "$f" | cut -c1-220; }
  done
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  true  # (a log with no such line: the table still ends the script with status 0)
} | table
