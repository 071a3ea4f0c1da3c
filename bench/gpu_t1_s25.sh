#!/usr/bin/env bash
# t1's device script, session 25 (issue 14: T1 and the replay).
# B: the 28-layer decode replay (S=8, then S=1; multi-weight calls, top-64 lm-head) with gRPC's
#    EventEngine off, which `q6serve worker` does itself since 56c1add (client/grpc_env.py),
#    against gRPC's defaults: bench/replay_ab.py, one worker per worker environment, uploads
#    once, runs alternated: main (the tree's defaults: the worker EE off, the replay's caller
#    on gRPC's defaults), gd (the worker on gRPC's defaults, GRPC_EXPERIMENTS empty: session
#    24's closing check's worker), eh (main's worker, the caller's gRPC EE off too:
#    replay_ab's host.ee=off). The replay had no figure with the EventEngine off.
#   PHASE=b bash bench/gpu_t1_s25.sh   env: BOUND (75), BACKEND (cuda), LAYERS (28), SCALE (1),
#     SECONDS_RUN (1.0), ORDER
# C: T1 as the closing check runs it (bench/service.py --target-report --targets T1), unpinned
#    and with the worker (and its echo floors) and the caller pinned to the cores a probe finds
#    fastest (bench/machine_probe.py's pure-Python loop per core, bench/service_pin.py; session 24's
#    probe saw 5-8 of 16 cores at 47-75 ns an iteration against 32-38 on the others), the
#    worker's loop busy-polling in both (Q6SERVE_BUSY_POLL_US=1000: pinned to fewer than 8
#    cores it would not), then, if the bound leaves time, pinned to the slowest cores.
#   PHASE=c bash bench/gpu_t1_s25.sh   env: BOUND (60), BACKEND (cuda), WCORES (2), LCORES (2)
# D: which side's pinning closes T1's gap (C: both pinned 166 / 167 us beyond the kernel, met,
#    fastest cores or slowest alike; unpinned 398, missed): T1 as C runs it, unpinned (free),
#    both pinned (wc), the worker only (w: its --cpus, the echo floor's server alike), the
#    callers only (c: the T1 caller and the floors' callers), then w and c again if the bound
#    leaves time; the callers' gRPC EventEngine off by the client library's default now (every
#    process of the bench: q6serve.client's import, client/grpc_env.py).
#   PHASE=d bash bench/gpu_t1_s25.sh   env: BOUND (75), BACKEND (cuda), WCORES (2), LCORES (2)
# E: T1 with bench/service.py --pin auto (the worker and the echo floor's server on the 2 cores
#    a probe finds fastest, the callers on the next 2, the loop busy-polling) against unpinned,
#    alternated: free, auto, auto, free (then auto if the bound leaves time); nothing exported
#    (the free runs at the defaults: busy polling on 16 cores).
#   PHASE=e bash bench/gpu_t1_s25.sh   env: BOUND (60), BACKEND (cuda)
# F: the 28-layer replay (S=1, then S=8; multi-weight) as the closing check runs it, with
#    --pin auto (the worker, and the floors' echo servers, on the 2 fastest cores of a probe,
#    busy-polling; the replay host and the floors' callers on the next 2): the check on
#    067daa7 read S=1 57.73 ms / S=8 76.51 unpinned, where bundle B's replay_ab read 27.55 /
#    61.90 on a faster host, every CPU part of both processes 1.9-2.6x slower (the check's
#    hosts ran on the machine's slowest cores, 12 and 13); T1 --pin auto first (as the check
#    runs T1, pinned).
#   PHASE=f bash bench/gpu_t1_s25.sh   env: BOUND (75), BACKEND (cuda)
# G: the replay through bench/service.py --replay (its own worker, no floors) and through
#    bench/replay_ab.py (one worker; ab: replay_ab's requests, precision auto; f16: precision
#    f16, service.py's default) on one machine and one tree, S=1 (SEQS), multi: bundle B's
#    replay_ab read S=1 27.55 ms where the check's and bundle D's service.py read 57.73 /
#    62.11 on other machines and trees.
#   PHASE=g bash bench/gpu_t1_s25.sh   env: BOUND (60), BACKEND (cuda), LAYERS (28), SCALE (1),
#     SEQS (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-b}
gpu_session "/tmp/t1"
if [[ $PHASE == b ]]; then
  BOUND=${BOUND:-75}
  step probe 6 python3 bench/machine_probe.py --label start --json "$OUT/probe.json"
  # replay_ab's own bound: no run starts that would end past it (8 s kept for the table)
  rest=$(($(bound 1000 8) - 1))
  step replay "$(bound 70 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --variants "main: gd:GRPC_EXPERIMENTS= eh:host.ee=off" \
    --order "${ORDER:-main,gd,eh,eh,gd,main,main,gd,eh}" --seqs 8,1 \
    --seconds "${SECONDS_RUN:-1.0}" --warmup 0.4 --bound "$rest" --out-dir "$OUT" \
    --json "$OUT/replay.json"
  {
    echo "# gpu_t1_s25 PHASE=b $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "^probe " "$OUT/probe.log"
    grep -hE "gRPC: GRPC_EXPERIMENTS" "$OUT"/worker_*.log | cut -c1-160
    grep -E "given|skipped|FAILED|host gRPC" "$OUT/replay.log" | cut -c1-200
    sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-400
  } | table
elif [[ $PHASE == g ]]; then
  BOUND=${BOUND:-60}
  step svc "$(bound 24 21)" python3 bench/service.py --backend "${BACKEND:-cuda}" --replay \
    --replay-seqs "${SEQS:-1}" --multi on --seconds 1.0 --warmup 0.4 --no-replay-floor \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --json "$OUT/svc.json"
  rest=$(($(bound 1000 4) - 1))
  step ab "$(bound 40 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
    --variants "ab: f16:host.precision=f16" --order ab,f16,ab,f16 --seqs "${SEQS:-1}" \
    --seconds 1.0 \
    --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/ab.json"
  {
    echo "# gpu_t1_s25 PHASE=g $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "^# uploaded|^replay |^    per step|^    per call" "$OUT/svc.log" | cut -c1-200
    grep -E "given|skipped|FAILED|host gRPC" "$OUT/ab.log" | cut -c1-200
    sed -n '/^# replay A\/B/,$p' "$OUT/ab.log" | cut -c1-400
  } | table
elif [[ $PHASE == f ]]; then
  BOUND=${BOUND:-75}
  # T1 first, as the closing check runs it (1.0 s timed) but pinned: the cheaper figure
  step t1 "$(bound 22 30)" python3 bench/service.py --backend "${BACKEND:-cuda}" \
    --target-report --targets T1 --modes stream --weights ffn_down --seconds 1.0 \
    --warmup 0.3 --pin auto --json "$OUT/t1.json"
  step replay "$(bound 60 1)" python3 bench/service.py --backend "${BACKEND:-cuda}" --replay \
    --replay-seqs 1,8 --multi on --seconds 1.0 --warmup 0.4 --pin auto \
    --json "$OUT/replay.json"
  {
    echo "# gpu_t1_s25 PHASE=f $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "^# --pin|^# callers' gRPC|^# uploaded|^replay |^    per step|floor per step" \
      "$OUT/replay.log" | cut -c1-240
    [[ -f $OUT/t1.log ]] && grep -hE "^# --pin|^T1 |mean us|bare gRPC round trip|MISSED|met$" \
      "$OUT/t1.log" | cut -c1-220
  } | table
elif [[ $PHASE == e ]]; then
  BOUND=${BOUND:-60}
  t1() {  # RUN [ARGS...]: T1 as bench/gpu_check.sh runs it
    local run=$1
    shift
    step "$run" "$(bound 24 1)" python3 bench/service.py --backend "${BACKEND:-cuda}" \
      --target-report --targets T1 --modes stream --weights ffn_down --seconds 0.8 \
      --warmup 0.3 --json "$OUT/$run.json" "$@"
  }
  runs=(free_1 auto_1 auto_2 free_2 auto_3)
  t1 free_1
  left 10 && t1 auto_1 --pin auto
  left 10 && t1 auto_2 --pin auto
  left 10 && t1 free_2
  left 10 && t1 auto_3 --pin auto
  {
    echo "# gpu_t1_s25 PHASE=e $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hm1 "^# callers' gRPC" "$OUT/free_1.log" 2>/dev/null | cut -c1-160
    for r in "${runs[@]}"; do
      [[ -f $OUT/$r.log ]] || continue
      echo "## $r"
      grep -hE "^# --pin|^T1 |mean us|bare gRPC round trip|MISSED|met$" "$OUT/$r.log" | cut -c1-220
    done
  } | table
elif [[ $PHASE == c || $PHASE == d ]]; then
  [[ $PHASE == c ]] && BOUND=${BOUND:-60} || BOUND=${BOUND:-75}
  export Q6SERVE_BUSY_POLL_US=1000
  step probe 6 python3 bench/machine_probe.py --label start --json "$OUT/probe.json"
  step pins 4 python3 bench/service_pin.py "$OUT/probe.json" "${WCORES:-2},${LCORES:-2}"
  fast=$(grep -oE "^fastest [0-9,:-]+" "$OUT/pins.log" | cut -d' ' -f2)
  slow=$(grep -oE "^slowest [0-9,:-]+" "$OUT/pins.log" | cut -d' ' -f2)
  t1() {  # RUN [ARGS...]: T1 as bench/gpu_check.sh runs it
    local run=$1
    shift
    step "$run" "$(bound 24 1)" python3 bench/service.py --backend "${BACKEND:-cuda}" \
      --target-report --targets T1 --modes stream --weights ffn_down --seconds 0.8 \
      --warmup 0.3 --json "$OUT/$run.json" "$@"
  }
  if [[ $PHASE == c ]]; then
    runs=(t1_fast t1_free t1_slow)
    if [[ -n $fast ]]; then t1 t1_fast --pin "$fast"; else note "# no fastest cores"; fi
    t1 t1_free
    if [[ -n $slow ]] && left 16; then t1 t1_slow --pin "$slow"; else note "# t1_slow not run"; fi
  else
    runs=(t1_free t1_wc t1_w t1_c t1_c2 t1_w2)
    t1 t1_free
    if [[ -n $fast ]]; then
      t1 t1_wc --pin "$fast"
      left 10 && t1 t1_w --pin "${fast%%:*}:"
      left 10 && t1 t1_c --pin ":${fast##*:}"
      left 10 && t1 t1_c2 --pin ":${fast##*:}"
      left 10 && t1 t1_w2 --pin "${fast%%:*}:"
    else
      note "# no fastest cores: nothing pinned"
    fi
  fi
  {
    echo "# gpu_t1_s25 PHASE=$PHASE $(tree_commit) total $(elapsed); fast $fast slow $slow"
    steps
    machine_summary
    grep -hE "^probe |cpu loop ns" "$OUT/probe.log" | cut -c1-240
    cat "$OUT/pins.log"
    grep -hm1 "^# callers' gRPC" "$OUT/t1_free.log" 2>/dev/null | cut -c1-160
    for r in "${runs[@]}"; do
      [[ -f $OUT/$r.log ]] || continue
      echo "## $r"
      grep -hE "^T1 |mean us|bare gRPC round trip|MISSED|met$" "$OUT/$r.log" | cut -c1-220
    done
  } | table
fi
exit 0
