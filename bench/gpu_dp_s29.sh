#!/usr/bin/env bash
# Session 29, issue 15 (dp), one script for the bundles (session 28's: `git show
# 3fa8b61:bench/gpu_dp_s28.sh`, docs/SCALEOUT.md "Session 28").
#  a (bound 100 s, bundle A): where a front end's region call costs the device process more
#    than a lane call, and what the lane's ring costs and gives.
#    1. T3 over system regions through gRPC (bench/service.py --dataplane --targets T3
#       --regions system: 8 hosts x 1 caller of N=64 on ffn_down, 6 front ends round robin) and
#       T3's shape through the lane (bench/frontend_cpu.py --lane, --frontends 2), the device
#       process's counters and stage timers on (Q6SERVE_DP_STATS; bench/device_stats_table.py
#       --stages): one run each (RUNS "t3sst lanest"), the same host.
#    2. py-spy (1000 Hz, by function, SPY_S s) on the device process and one front end at once
#       under T3 over system regions (SPY "t3s"; "t3s t3": the lane row too),
#       bench/spy_summary.py.
#    3. The idle cost of the lane's ring (bench/lane_idle.py: one worker, 8 lanes open and
#       idle, none / ring / socket / ring, IDLE_S s each): the worker's CPU and switches, this
#       tree (IDLE "idle idlebase") against main's service/threads.py and lane.py (the spin
#       after each idle 5 ms wake, the poll kept after the last ring lane closed).
#    4. T3 through the lane over the socket against the ring (AB_T3R "lsock lring lring
#       lsock", T3_S s a run), while the bound allows.
#  b (bound 100 s, bundle B): this tree against main aef7928 (copies of main's files on a
#    PYTHONPATH overlay: bench/dp_s29/<dir>__<file>.py.txt -> <dir>/<file>.py; without them
#    both variants run this tree's; "new" also has bench/dp_s29/*.patch applied: t1's
#    service/servicer.py taking a region call through the front end's
#    _PlaneProxy.start_matmul, no task a call), alternated (AB_DP "dnew dbase dbase dnew dnew
#    dbase"): one worker a run, T2 over system regions, T3 over system and over CUDA regions
#    (bench/service.py --dataplane --targets T2,T3 --regions system --cuda-regions, 6 front
#    ends round robin, SECONDS_PER_RUN 1 s each); AB_T3S / AB_T2S: T3 / T2 alone, after.
#  c (bound 60 s, bundle C): the ring's idle cost with this tree's fixes (IDLE "idle"), then
#    T3 over system regions through 6 front ends against 2 alternated, the device process's
#    counters on (AB_FE "t3f6st:FE=6 t3f2st:FE=2 t3f2st:FE=2 t3f6st:FE=6"), then AB_T3R (T3
#    through the lane, e.g. "lsock:Q6SERVE_LANE_RING=0 lring:Q6SERVE_LANE_RING=1"; none by
#    default) while the bound allows.
#  d (bound 40 s, bundle D): the ring in an object of its own and the caller's default ring
#    (second shift) on the device: bench/lane_latency.py --check over the lane's socket and its
#    ring alternated (LL_RINGS "sock,ring,ring,sock", LL_S s each: y checked against the
#    reference, p50 - kernel a way), then AB_T3R (T3 through the lane: default "ldef", the
#    caller's default = the ring) while the bound allows.
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s29.sh   env: PHASE (a), BOUND (95), NEED (12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), RUNS, AB_T3R, T3_S (1), SPY,
#                         SPY_S (2), IDLE, IDLE_S (1.5), IDLE_PHASES, AB_DP,
#                         AB_T3S, AB_T2S, AB_FE, FE (6), HOSTS (8),
#                         SECONDS_PER_RUN
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
SPY_BIN=${SPY_BIN:-/tmp/site/bin/py-spy}
[[ -x $SPY_BIN ]] || SPY_BIN=$(command -v py-spy || true)
# both variants from copies on a PYTHONPATH overlay, alike but for main's files in the base:
# /tmp/dp_new is this tree's service/ and client/, /tmp/dp_base the same with main's files on
# them (session 28's bundle A read "new" installed against "base" overlaid 0.44-0.51 / 0.56-0.57
# on code that was the same for that load)
for v in new base; do
  mkdir -p "/tmp/dp_$v"
  for d in kernels proto; do ln -sfn "$PWD/$d" "/tmp/dp_$v/$d"; done
  for d in service client; do rm -rf "/tmp/dp_$v/$d" && cp -r "$d" "/tmp/dp_$v/$d"; done
done
# (main's copies live on branch wt-dp only: a copy of a product file stays off main)
found=0
for f in bench/dp_s29/*__*.py.txt; do
  [[ -f $f ]] || continue
  g=${f##*/}
  g=${g%.txt}
  cp "$f" "/tmp/dp_base/${g%%__*}/${g#*__}" && found=$((found + 1))
  echo "# base: ${g%%__*}/${g#*__} from $f"
done
((found)) || echo "# no bench/dp_s29/*.py.txt: base and new run the same code"
# another helper's file changed for "new" only: bench/dp_s29/*.patch onto /tmp/dp_new (a
# proposal measured, its file left as it is in this tree)
for f in bench/dp_s29/*.patch; do  # (phase b's "new" only)
  [[ -f $f && $PHASE == b ]] || continue
  patch -s -d /tmp/dp_new -p1 <"$f" && echo "# new: $f applied" || echo "# new: $f FAILED"
done
mkdir -p /tmp/dp_newpath/q6serve
for d in kernels service client; do ln -sfn "/tmp/dp_new/$d" "/tmp/dp_newpath/q6serve/$d"; done
ln -sfn "$PWD/proto/q6serve/v1" /tmp/dp_newpath/q6serve/v1
NEWPP="/tmp/dp_newpath${PYTHONPATH:+:$PYTHONPATH}"
base_tree /tmp/dp_base
newpp() {  # newpp NAME: PYTHONPATH for a run that is not a base one (this tree's overlay)
  [[ $1 == *base* ]] && echo "$BASEPP" || echo "$NEWPP"
}
stats() {  # stats RUN: the device process's counters for runs whose name ends in "st"
  [[ $1 == *st_* || $1 == spy_* ]] && echo "Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl"
  true
}
t3s() {  # t3s RUN NAME: bench/service.py's T3 over system regions (or T3_REGIONS), 6 front ends
  local t=$SECONDS st
  st=$(stats "$1")
  PYTHONPATH=$(newpp "$2") env ${st:+"$st"} Q6SERVE_FRONTEND_ROUND_ROBIN=1 \
    timeout "$(bound "${T3S_LIMIT:-30}" 1)" python3 bench/service.py --backend "$BACKEND" \
    --dataplane --modes stream --frontends "${FE:-6}" --t3-hosts "${HOSTS:-8}" \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T3 --regions "${T3_REGIONS:-system}" \
    ${T3_ARGS:-} --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T3 ${T3_REGIONS:-system} regions, ${FE:-6} front ends) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
t2s() {  # t2s RUN NAME: bench/service.py's T2 over system regions, 6 front ends round robin
  local t=$SECONDS st
  st=$(stats "$1")
  PYTHONPATH=$(newpp "$2") env ${st:+"$st"} Q6SERVE_FRONTEND_ROUND_ROBIN=1 \
    timeout "$(bound 30 1)" python3 bench/service.py --backend "$BACKEND" \
    --dataplane --modes stream --frontends 6 --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 \
    --targets T2 --regions system --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T2 system regions, 6 front ends) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
t3() {  # t3 RUN NAME: T3's shape through the lane (8 hosts x 1 caller of N=64, 2 front ends)
  local t=$SECONDS st
  st=$(stats "$1")
  PYTHONPATH=$(newpp "$2") env ${st:+"$st"} timeout "$(bound 30 1)" python3 bench/frontend_cpu.py \
    --backend "$BACKEND" --rows $ROWS --k $K --n 64 --lane --frontends 2 --hosts "${HOSTS:-8}" \
    --callers 1 --seconds "${T3_S:-1}" --warmup 0.5 --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T3 lane${Q6SERVE_LANE_RING:+, ring $Q6SERVE_LANE_RING}) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
dpx() {  # dpx RUN NAME: bench/service.py's T2 and T3 over system regions and T3 over CUDA
  # regions, 6 front ends round robin, one worker (ask 1's judges in one run)
  local t=$SECONDS st
  st=$(stats "$1")
  PYTHONPATH=$(newpp "$2") env ${st:+"$st"} Q6SERVE_FRONTEND_ROUND_ROBIN=1 \
    timeout "$(bound 40 1)" python3 bench/service.py --backend "$BACKEND" \
    --dataplane --modes stream --frontends 6 --t3-hosts "${HOSTS:-8}" \
    --seconds "${SECONDS_PER_RUN:-1}" --warmup 0.3 --targets T2,T3 --regions system \
    $([[ $BACKEND == cuda ]] && echo --cuda-regions) --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T2 + T3 system, T3 cuda; 6 front ends) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
idle() {  # idle RUN NAME: what 8 idle lanes cost the worker, none / socket / ring alternated
  local t=$SECONDS
  PYTHONPATH=$(newpp "$2") timeout "$(bound 40 1)" python3 bench/lane_idle.py --backend "$BACKEND" \
    --rows $ROWS --k $K --lanes 8 --seconds "${IDLE_S:-1.5}" \
    --phases "${IDLE_PHASES:-none,ring,sock,ring}" --json "$OUT/$1.json" \
    >"$OUT/$1.log" 2>&1
  note "# $1 (idle lanes) rc=$? in $((SECONDS - t)) s at $(elapsed)"
  archive 2>/dev/null
}
spy() {  # spy WHAT (t3s, t3): WHAT's run, its device process under py-spy for SPY_S s once its
  # counters (Q6SERVE_DP_STATS, a line a second) show the load's calls
  local what=$1 stem=spy_$1 pat='"lane_requests": [1-9]' pid dev fe="" fspy="" i
  [[ $what == t3s ]] && pat='"msg_rm": [1-9]'
  left 16 || { note "# $stem skipped at $(elapsed) (bound $BOUND s)"; return 0; }
  SECONDS_PER_RUN=3.5 T3_S=3.5 "$what" "$stem" new &
  pid=$!
  for ((i = 0; i < 150; i++)); do  # (up to 15 s: the worker's start, the weight's upload)
    grep -q "$pat" "$OUT/dpstats_$stem.jsonl" 2>/dev/null && break
    sleep 0.1
  done
  dev=$(worker_pid 4)
  if [[ -n $SPY_BIN && -n $dev ]] && ((i < 150)); then
    fe=$(pgrep -P "$dev" | head -1)  # a front end (the device process's children) beside it
    if [[ -n $fe ]]; then
      timeout 20 "$SPY_BIN" record --pid "$fe" --duration "${SPY_S:-2}" --rate 1000 \
        --nonblocking --threads --function --format raw --output "$OUT/${stem}_fe.txt" \
        >"$OUT/${stem}_fe.spylog" 2>&1 &
      fspy=$!
    fi
    timeout 20 "$SPY_BIN" record --pid "$dev" --duration "${SPY_S:-2}" --rate 1000 --nonblocking \
      --threads --function --format raw --output "$OUT/$stem.txt" >"$OUT/$stem.spylog" 2>&1
    note "# $stem py-spy rc=$? (pid $dev; front end ${fe:-none}) at $(elapsed)"
    [[ -n $fspy ]] && wait "$fspy"
  else
    note "# $stem: no profile (py-spy '${SPY_BIN:-none}', device process '${dev:-none}', load \
seen: $((i < 150)))"
  fi
  wait "$pid"
  if [[ -f $OUT/${stem}_fe.txt ]]; then  # the front end: every thread, then its loop's callbacks
    timeout 20 python3 bench/spy_summary.py "$OUT/${stem}_fe.txt" --top 40 \
      >"$OUT/${stem}_fe.summary" 2>&1
    timeout 20 python3 bench/spy_summary.py "$OUT/${stem}_fe.txt" --top 30 --thread MainThread \
      --under asyncio/events.py --depth 2 | sed -n '/^under/,$p' >>"$OUT/${stem}_fe.summary" 2>&1
  fi
  if [[ -f $OUT/$stem.txt ]]; then  # the loop thread: frames, then the loop's callbacks
    timeout 20 python3 bench/spy_summary.py "$OUT/$stem.txt" --top 40 --thread MainThread \
      >"$OUT/$stem.summary" 2>&1
    timeout 20 python3 bench/spy_summary.py "$OUT/$stem.txt" --top 30 --thread MainThread \
      --under asyncio/events.py --depth 2 | sed -n '/^under/,$p' >>"$OUT/$stem.summary" 2>&1
  fi
  archive 2>/dev/null
}
case $PHASE in
  a)
    for r in ${RUNS-t3sst lanest}; do  # the device process's stages, gRPC region calls and lane
      left "${NEED:-12}" || { note "# $r skipped at $(elapsed)"; continue; }
      case $r in
        t3s*) t3s "${r}_1" new ;;
        *) t3 "${r}_1" new ;;
      esac
    done
    for w in ${SPY-t3s}; do spy "$w"; done
    # shellcheck disable=SC2086  # (run names)
    ab_runs 14 idle ${IDLE-idle idlebase}
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-12}" t3 ${AB_T3R-lsock:Q6SERVE_LANE_RING=0 lring:Q6SERVE_LANE_RING=1 lring:Q6SERVE_LANE_RING=1 lsock:Q6SERVE_LANE_RING=0}
    ;;
  b)
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-16}" dpx ${AB_DP-dnew dbase dbase dnew dnew dbase}
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-14}" t3s ${AB_T3S-}
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-14}" t2s ${AB_T2S-}
    ;;
  c)
    # shellcheck disable=SC2086  # (run names)
    ab_runs 14 idle ${IDLE-idle}
    # T3 over system regions through 6 front ends and through 2 (4 calls in flight a front
    # end: a read and a trip of the device process carry several calls), counters on: whether
    # the per-call reads and trips are what a front-end call costs the device process more
    # shellcheck disable=SC2086  # (run names)
    SECONDS_PER_RUN=${SECONDS_PER_RUN:-1} ab_runs "${NEED:-11}" t3s ${AB_FE-t3f6st:FE=6 t3f2st:FE=2 t3f2st:FE=2 t3f6st:FE=6}
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-9}" t3 ${AB_T3R-}
    ;;
  d)
    t=$SECONDS
    PYTHONPATH=$NEWPP timeout "$(bound 30 2)" python3 bench/lane_latency.py --backend "$BACKEND" \
      --rows $ROWS --k $K --paths lane --check --rings "${LL_RINGS:-sock,ring,ring,sock}" \
      --seconds "${LL_S:-1}" --warmup 0.3 --json "$OUT/ll_rings.json" >"$OUT/ll_rings.log" 2>&1
    note "# ll_rings (lane_latency --rings) rc=$? in $((SECONDS - t)) s at $(elapsed)"
    archive 2>/dev/null
    # shellcheck disable=SC2086  # (run names)
    ab_runs "${NEED:-9}" t3 ${AB_T3R-ldef}
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE"
  for f in "$OUT"/*.log; do
    case ${f##*/} in
      t3s*|t3f*|t3new*|t3base*|t2*|spy_t3s*|dnew*|dbase*)
        echo "# ${f##*/}"
        grep -h -E "^# T[23] stream" "$f" | cut -c1-200
        grep -h -E -A1 "^T[23] fe=" "$f" | grep -v "^--" | cut -c1-200 | tr -s ' ' ;;
      ll_*)
        echo "# ${f##*/}"
        grep -h -E "^lane |^rings |check:" "$f" | cut -c1-200 | tr -s ' ' ;;
      lane*|lsock*|lring*|ldef*|spy_t3*)
        echo "# ${f##*/}: $(grep -h -A1 "lane load" "$f" | cut -c1-260 | tr -s ' ')"
        grep -h "cpu (cores\|CPU " "$f" | head -2 | cut -c1-200 ;;
      idle*) echo "# ${f##*/}"; grep -h "^idle" "$f" ;;
    esac
  done
  if compgen -G "$OUT/dpstats_*.jsonl" >/dev/null; then
    echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
    python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  fi
  for f in "$OUT"/spy_*.summary; do
    [[ -f $f ]] && { echo "# ${f##*/}"; head -45 "$f" | cut -c1-160; }
  done
  true  # (no logs: the table still ends the script with status 0)
} | table
