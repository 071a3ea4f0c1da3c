#!/usr/bin/env bash
# t1's device script, session 30 (issue 14): the decode replay's step, with the caller's loop
# spinning (the replay host busy-polls SPIN us before it sleeps: bench/service.py
# --replay-spins, bench/replay_ab.py host.spin) x the CPUs kept awake (a SCHED_IDLE spinner per
# CPU: the worker's --keep-cpus-awake), 2x2, alternated in rounds. Session 29 measured each lever
# alone (the spin: S=8 88.3 -> 77.5 ms, 2 runs; the spinners: S=8 -11.7%, 4 pairs; closing check
# S=8 85.9 -> 55.6, not alternated); never the two together, nor against each other in one call.
# A: one worker, the 2x2 in bench/replay_ab.py, the keep-awake axis as sys.hold=idlespin: the
#    worker's own KeepAwake class (service/keep_awake.py, the spinners --keep-cpus-awake starts)
#    toggled around each run, since a worker's own spinners live as long as it does and would
#    hold every run of the A/B. Order ABCD DCBA per round (ROUNDS, >= 2), S = SEQS (8,1). The
#    table: per run step p50 / p99 ms and the step's parts (worker (device), transport, client,
#    the caller's CPU), then per S the median of the runs and the per-call-role p50s.
#    Answers: does the caller's spin add to the spinners (or does either make the other moot),
#    at S=1 and S=8?
#   PHASE=a bash bench/gpu_t1_s30.sh   env: BOUND (150), BACKEND (cuda), LAYERS (28), SCALE (1),
#     SPIN (2000), ROUNDS (2), SEQS (8,1), RSECONDS (0.8), ORDER (overrides the rounds)
# B: the worker option itself: bench/service.py --replay (its bare-gRPC floor and limit per
#    run, like for like with the caller's spin) on a worker started plain / with
#    --keep-cpus-awake, alternated (plain awake awake plain: one worker each run, the model
#    uploaded each time), each run with the caller's spins 0,SPIN,SPIN,0. Answers: does the
#    option, as a deployment runs it, give what A's hold gives, and how far is each cell from
#    its limit (1.5 x (calls x floor + kernel-only step))?
#   PHASE=b bash bench/gpu_t1_s30.sh   env: BOUND (240), BACKEND, SPIN, BSEQS (8,1),
#     BORDER ("plain awake awake plain"), BSECONDS (1.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/t1"
spin=${SPIN:-2000}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-150}
  python3 bench/cpu_hold.py | sed 's/^/# /'
  f16="host.precision=f16"
  variants="plain:$f16 spin:$f16,host.spin=$spin awake:$f16,sys.hold=idlespin"
  variants+=" both:$f16,host.spin=$spin,sys.hold=idlespin"
  order=${ORDER:-}
  if [[ -z $order ]]; then
    for ((r = 0; r < ${ROUNDS:-2}; r++)); do
      order+="${order:+,}plain,spin,awake,both,both,awake,spin,plain"
    done
  fi
  step replay "$(bound 1000 3)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --variants "$variants" --order "$order" \
    --seqs "${SEQS:-8,1}" --seconds "${RSECONDS:-0.8}" --warmup 0.3 \
    --bound "$(($(bound 1000 4) - 1))" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# gpu_t1_s30 PHASE=$PHASE $(tree_commit) total $(elapsed) SPIN=$spin"
    steps
    machine_summary
    grep -hE "FAILED|failed|skipped" "$OUT"/*.log | cut -c1-200
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
  } | table
fi
if [[ $PHASE == b ]]; then
  BOUND=${BOUND:-240}
  i=0
  for v in ${BORDER:-plain awake awake plain}; do
    i=$((i + 1))
    awake=()
    [[ $v == awake ]] && awake=(--keep-cpus-awake)
    if left 50; then
      step "replay${i}_$v" "$(bound 120 1)" python3 bench/service.py --backend "${BACKEND:-cuda}" \
        --replay --replay-seqs "${BSEQS:-8,1}" --multi on --replay-spins "0,$spin,$spin,0" \
        "${awake[@]}" --seconds "${BSECONDS:-1.0}" --warmup 0.4 --json "$OUT/replay${i}_$v.json"
    else
      note "# replay${i}_$v not run at $(elapsed) (bound $BOUND s)"
    fi
  done
  {
    echo "# gpu_t1_s30 PHASE=$PHASE $(tree_commit) total $(elapsed) SPIN=$spin"
    steps
    machine_summary
    grep -hE "FAILED|failed|skipped" "$OUT"/*.log | cut -c1-200
    for f in "$OUT"/replay*.log; do
      [[ -f $f ]] && grep -E "^replay S=|loop spinning|per step p50|keep awake" "$f" | cut -c1-260 \
        | sed "s/^/$(basename "$f" .log) /"
    done
  } | table
fi
exit 0
