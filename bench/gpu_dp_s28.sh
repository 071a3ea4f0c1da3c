#!/usr/bin/env bash
# Session 28, issue 15 (dp), one script for the bundles (session 27's: `git show
# d9bb665:bench/gpu_dp_s27.sh`, docs/SCALEOUT.md "Session 27").
#  a (bound 100 s, bundle A): this tree against main 1e0f9dc alternated, main's files being
#    copies on a PYTHONPATH overlay of this tree (bench/dp_s28/<dir>__<file>.py.txt ->
#    <dir>/<file>.py: ab_runs' "base" variants; without them both variants run this tree's):
#    1. the lane latency (issue 15's stretch: bench/lane_latency.py, one caller of N=1 on
#       ffn_down through the fast lane, y checked; p50 - kernel <= 50 us), one worker a run,
#       alternated AB_LAT (spare new base base new new base: medians of 3 pairs; "spare", not
#       counted, runs first: the first worker of a bundle compiles the kernels, and session
#       27's T1 read such a worker slower for its whole life).
#    2. T3's shape through the lane (bench/frontend_cpu.py --lane: 8 hosts x 1 caller of N=64,
#       --frontends 2; the row is 0.5 of the kernel alone), AB_T3 (lnew baselane: the change
#       is the caller's x copy, which this load does not make): rows/s, the kernel fraction,
#       the device process's CPU a call.
#    3. one more T3 lane run (T3ST: lnewst) with the device process's counters and stage timers
#       on (Q6SERVE_DP_STATS, bench/device_stats_table.py --stages): where a lane call goes.
#  b (bound 100 s, bundle B): the lane latency alternated AB_LAT (a spare, then 4 pairs), with
#    STAMPS=1 its stamped parts in one more run a variant (stnew basest; off by default), T3
#    through the lane this tree / main's alternated AB_T3 (lnew baselane baselane lnew), then
#    bench/lane_ring_probe.py (the lane's socket against a shm ring, an echo for the job) at
#    RING_CALLERS (8) callers.
#  d (bound 45 s, bundle D): the lane's shared-memory ring (opt-in Q6SERVE_LANE_RING=1)
#    against its socket: 1. one worker, one caller of N=1 on ffn_down, the lane over the socket
#    and over the ring alternated in one process (bench/lane_latency.py --rings RINGS: no
#    worker-to-worker spread between the two; RINGW workers, each a run); 2. T3's shape through
#    the lane, socket against ring (AB_T3R: lsock lring; T3_S 1), while the bound allows.
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s28.sh   env: PHASE (a), BOUND (95), NEED (12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), AB_LAT, AB_T3, T3ST, RING_CALLERS, LAT_S (1),
#                         T3_S (1.5),
#                         STAMPS (b: 0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
# both variants from copies on a PYTHONPATH overlay, alike but for main's files in the base
# (bundle A ran "new" from the installed package and "base" from an overlay: T3's lane rows
# then split 0.44-0.51 / 0.56-0.57 on code that was the same for that load): /tmp/dp_new is this
# tree's service/ and client/, /tmp/dp_base the same with main's files on them
for v in new base; do
  mkdir -p "/tmp/dp_$v"
  for d in kernels proto; do ln -sfn "$PWD/$d" "/tmp/dp_$v/$d"; done
  for d in service client; do rm -rf "/tmp/dp_$v/$d" && cp -r "$d" "/tmp/dp_$v/$d"; done
done
# (main's copies live on branch wt-dp only: a copy of a product file stays off main)
found=0
for f in bench/dp_s28/*__*.py.txt; do
  [[ -f $f ]] || continue
  g=${f##*/}
  g=${g%.txt}
  cp "$f" "/tmp/dp_base/${g%%__*}/${g#*__}" && found=$((found + 1))
  echo "# base: ${g%%__*}/${g#*__} from $f"
done
((found)) || echo "# no bench/dp_s28/*.py.txt: base and new run the same code"
# this tree's overlay, as gpu_lib.sh's base_tree makes one (whose folder is one a shell)
mkdir -p /tmp/dp_newpath/q6serve
for d in kernels service client; do ln -sfn "/tmp/dp_new/$d" "/tmp/dp_newpath/q6serve/$d"; done
ln -sfn "$PWD/proto/q6serve/v1" /tmp/dp_newpath/q6serve/v1
NEWPP="/tmp/dp_newpath${PYTHONPATH:+:$PYTHONPATH}"
PYTHONPATH=$NEWPP python3 -c "import q6serve.service as s; print('# new code', s.__file__)"
base_tree /tmp/dp_base
newpp() {  # newpp NAME: PYTHONPATH for a run that is not a base one (this tree's overlay)
  [[ $1 == base* ]] && echo "$PYTHONPATH" || echo "$NEWPP"
}
for v in new base; do  # which code each variant runs (the lane's caller and worker files)
  pp=$NEWPP
  [[ $v == base ]] && pp=$BASEPP
  PYTHONPATH=$pp python3 -c "import q6serve.client.lane as c, q6serve.service.lane as s
print('# $v:', c.__file__, 'x place kept:', hasattr(c.Lane, '_x_place'), '|', s.__file__)"
done
lat() {  # lat RUN NAME: bench/lane_latency.py, the lane only, y checked
  local t=$SECONDS
  PYTHONPATH=$(newpp "$2") timeout "$(bound 30 1)" python3 bench/lane_latency.py --backend "$BACKEND" --rows $ROWS \
    --k $K --paths lane --check --seconds "${LAT_S:-1}" --warmup 0.2 --label "$1" \
    --json "$OUT/$1.json" ${LAT_ARGS:-} >"$OUT/$1.log" 2>&1
  note "# $1 (lane latency) rc=$? in $((SECONDS - t)) s at $(elapsed)"
}
t3() {  # t3 RUN NAME: T3's shape through the lane (8 hosts x 1 caller of N=64, 2 front ends)
  local t=$SECONDS st=()
  [[ $1 == *st_* ]] && st=(env "Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl")  # (the counters on)
  PYTHONPATH=$(newpp "$2") "${st[@]}" timeout "$(bound 30 1)" python3 bench/frontend_cpu.py --backend "$BACKEND" --rows $ROWS \
    --k $K --n 64 --lane --frontends 2 --hosts 8 --callers 1 --seconds "${T3_S:-1.5}" \
    --warmup 0.5 --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T3 lane) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
latr() {  # latr RUN NAME: the lane over its socket and its ring alternated on one worker
  local t=$SECONDS
  PYTHONPATH=$(newpp "$2") timeout "$(bound 30 1)" python3 bench/lane_latency.py --backend "$BACKEND" --rows $ROWS \
    --k $K --paths lane --check --seconds "${LAT_S:-1}" --warmup 0.2 --label "$1" \
    --rings "${RINGS:-sock,ring,ring,sock,sock,ring}" --json "$OUT/$1.json" \
    >"$OUT/$1.log" 2>&1
  note "# $1 (lane socket vs ring, one worker) rc=$? in $((SECONDS - t)) s at $(elapsed)"
}
case $PHASE in
  d)
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" latr ${RINGW-rw}
    archive 2>/dev/null
    # shellcheck disable=SC2086  # (run names)
    T3_S=${T3_S:-1} ab_runs "${NEED:-12}" t3 ${AB_T3R-lsock:Q6SERVE_LANE_RING=0 lring:Q6SERVE_LANE_RING=1}
    ;;
  a)
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" lat ${AB_LAT-spare new base base new new base}
    archive 2>/dev/null
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" t3 ${AB_T3-lnew baselane}
    # the device process's counters and stage timers in one more run (T3ST): where a lane
    # call's CPU goes on this host
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" t3 ${T3ST-lnewst}
    ;;
  b)
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" lat ${AB_LAT-spare new base base new new base base new}
    archive 2>/dev/null
    if [[ ${STAMPS:-0} != 0 ]]; then  # the stamped parts, one run a variant
      LAT_ARGS="--stamps" ab_runs "${NEED:-12}" lat stnew basest
    fi
    # T3 through the lane, this tree against main's files, both from overlays (bundle A's
    # split was new installed against base overlaid). AB_T3 may name a switch a run, e.g.
    # "s0:Q6SERVE_REGION_STREAMS=0" (the plans' copy streams off: one stream, the copies
    # serialized with the kernels; not run: session 11's figures and the copies' share of a
    # call, ~2.4 MB of x, say it would cap the row near 0.4)
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" t3 ${AB_T3-lnew baselane baselane lnew}
    for c in ${RING_CALLERS-8}; do  # what the lane's socket costs against a shm ring
      left "${NEED:-12}" || break
      timeout "$(bound 25 1)" python3 bench/lane_ring_probe.py --callers "$c" --seconds 1.5 \
        --json "$OUT/ring_c$c.json" >"$OUT/ring_c$c.log" 2>&1
      note "# ring probe, $c callers: rc=$? at $(elapsed)"
    done
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE"
  python3 bench/lane_ab_table.py "$OUT" 2>&1
  for f in "$OUT"/ring_c*.log; do [[ -f $f ]] && grep -E "^(socket|ring)" "$f"; done
  for f in "$OUT"/rw*.log; do
    [[ -f $f ]] && { echo "# ${f##*/}"; grep -E "^(lane (sock|ring)|rings )" "$f" | cut -c1-200; }
  done
  for f in "$OUT"/st*.log "$OUT"/basest*.log; do
    [[ -f $f ]] && { echo "# ${f##*/}"; grep -E -A3 "^lane|stamp|pre_job|client_pre" "$f" | cut -c1-240; }
  done
  if compgen -G "$OUT/dpstats_*.jsonl" >/dev/null; then
    echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
    python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  fi
  true  # (no logs: the table still ends the script with status 0)
} | table
