#!/usr/bin/env bash
# t1's device script, session 26 (issue 14: the replay's worker window per call).
# A: the 28-layer decode replay (S=1, then S=8; multi-weight calls, top-64 lm-head, F16 as
#    bench/service.py --replay asks) with one backend call per multi-weight call
#    (Q6SERVE_MULTI_LAUNCH=1, ml) against the tree's default (off, main), alternated on one
#    machine by bench/replay_ab.py (one worker per variant, uploads once). Measured off three
#    times (sessions 14, 18) while each step's transport was 36-54 ms of gRPC with the
#    EventEngine on; since session 25 the replay's caller runs it off (S=1 ~27-34 ms a step,
#    the worker 15 of it), so the ~2.8 ms of window a step it saved may now show.
#   PHASE=a bash bench/gpu_t1_s26.sh   env: BOUND (95), BACKEND (cuda), LAYERS (28), SCALE (1),
#     SECONDS_RUN (1.0), ORDER, SEQS (1,8), VARIANTS
# B: A again, the order mirrored (ml first: A's 4 pairs split S=1 3:1 for ml, S=8 1:3, on a
#    slow host whose runs of one variant spread 45-70 ms; q+k+v's handler p50 300 -> 270 us at
#    S=1, 350 -> 290 at S=8), 6 runs; then the step's calls against a busy-polling echo
#    (bench/replay_echo.py), bare and each call held for main's handler p50s of these runs, for
#    today's plan (113 calls) and for one with each layer's MLP as one call (mlp: 85 calls,
#    gate+up -> down, the one boundary of a layer with no host state; held for gate+up's and
#    down's windows together, its reply down's y): what the fused call would leave of a step
#    and of its limit, through Python gRPC on this host.
#   PHASE=b bash bench/gpu_t1_s26.sh   env: as A, ECHO_SECONDS (0.6)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/t1"
if [[ $PHASE == a || $PHASE == b ]]; then
  BOUND=${BOUND:-95}
  # replay_ab's own bound: no run starts that would end past it (6 s kept for the table; B
  # keeps 26 s for the echo)
  keep=$([[ $PHASE == a ]] && echo 6 || echo 26)
  rest=$(($(bound 1000 "$keep") - 1))
  step replay "$(bound 90 $((keep - 4)))" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
    --variants "${VARIANTS:-main:host.precision=f16 ml:Q6SERVE_MULTI_LAUNCH=1,host.precision=f16}" \
    --order "${ORDER:-$([[ $PHASE == a ]] && echo main,ml,ml,main,main,ml,ml,main ||
      echo ml,main,main,ml,ml,main)}" --seqs "${SEQS:-1,8}" \
    --seconds "${SECONDS_RUN:-1.0}" --warmup 0.4 --bound "$rest" --out-dir "$OUT" \
    --json "$OUT/replay.json"
  if [[ $PHASE == b && -f $OUT/replay.json ]]; then
    step echo "$(bound 26 2)" python3 bench/replay_echo.py --seqs "${SEQS:-1,8}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --multi on,mlp \
      --holds-from "$OUT/replay.json" --holds-variant main --seconds "${ECHO_SECONDS:-0.6}" \
      --json "$OUT/echo.json"
  fi
  {
    echo "# gpu_t1_s26 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "gRPC: GRPC_EXPERIMENTS" "$OUT"/worker_*.log | cut -c1-160
    grep -E "given|skipped|FAILED|host gRPC" "$OUT/replay.log" | cut -c1-200
    sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-400
    [[ -f $OUT/echo.log ]] && grep -vE "Warning|nanmedian" "$OUT/echo.log" | cut -c1-200
  } | table
fi
exit 0
