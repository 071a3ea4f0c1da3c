#!/usr/bin/env bash
# Issue 14 T1, session 8 (helper t1): does keeping the worker's loop awake between a reply and
# the next request (Q6SERVE_BUSY_POLL_US, opt-in) take out what sleeping costs on the H200?
# (gpu_t1_bisect.sh: 100 us of client think time adds ~83 us to a bare echo's round trip; the
# direct job's host launch takes 57 us after 300 us asleep against 27 back to back.)
#  1. T1 (bench/service.py --target-report --targets T1 --modes stream --weights ffn_down),
#     plain / spin alternated twice (SPIN us, default 1000)
#  2. bench/stream_overhead.py --backend cuda --variants bare,worker --think 0,100, plain and spin
#  3. if time is left: the replay (--layers 4, S = 1, 8, multi-weight calls), plain and spin
# $OUT gets t1spin.tgz and summary.txt.   bench/gpu_t1_spin.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1spin
S=${SECONDS_PER_RUN:-1.0}
SPIN=${SPIN:-1000}
t1() {  # label [env...]
  local label=$1
  shift
  env "$@" timeout 40 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds "$S" >"$OUT/t1_$label.log" 2>&1
  note "# T1 $label rc=$? ($(elapsed)): $(grep -E '^# T1 stream' "$OUT/t1_$label.log")"
  grep -E "mean us" "$OUT/t1_$label.log" >>"$FINAL/progress.txt"
}
t1 plain1
t1 spin1 Q6SERVE_BUSY_POLL_US="$SPIN"
t1 plain2
t1 spin2 Q6SERVE_BUSY_POLL_US="$SPIN"
ladder() {  # label [env...]
  local label=$1
  shift
  (cd bench && env "$@" timeout 40 python3 stream_overhead.py --backend cuda --inproc 0 \
    --variants bare,worker --think 0,100 --rounds 1 --seconds 0.7 --warmup 0.15 \
    >"$OUT/ladder_$label.log" 2>&1)
  note "# ladder $label rc=$? ($(elapsed))"
}
ladder plain
ladder spin Q6SERVE_BUSY_POLL_US="$SPIN"
replay() {  # label [env...]
  local label=$1
  shift
  env "$@" timeout 40 python3 bench/service.py --backend cuda --replay --layers 4 \
    --replay-seqs 1,8 --multi on --seconds 1 --warmup 0.3 --no-replay-floor \
    >"$OUT/replay_$label.log" 2>&1
  note "# replay $label rc=$? ($(elapsed))"
}
if (($(date +%s) - T0 < ${REPLAY_BEFORE_S:-85})); then
  replay plain
  replay spin Q6SERVE_BUSY_POLL_US="$SPIN"
fi
{
  echo "# gpu_t1_spin $(cat COMMIT 2>/dev/null) SPIN=$SPIN $(elapsed)"
  for l in plain1 spin1 plain2 spin2; do
    echo "## T1 $l"
    grep -E "^T1|mean us|^# T1 stream|bare gRPC" "$OUT/t1_$l.log"
  done
  for l in plain spin; do
    echo "## stream_overhead $l"
    grep -vE "^# round" "$OUT/ladder_$l.log" | tail -6
  done
  for l in plain spin; do
    [[ -f $OUT/replay_$l.log ]] || continue
    echo "## replay $l"
    grep -E "^replay S|per step" "$OUT/replay_$l.log"
  done
} >"$OUT/summary.txt"
tar czf "$FINAL/t1spin.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
