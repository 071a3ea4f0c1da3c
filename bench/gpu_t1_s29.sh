#!/usr/bin/env bash
# t1's device script, session 29 (issue 14, ask 1: hold the CPUs out of deep idle while a
# worker serves; ask 2: T1's margin).
# The hold is machine-wide (the kernel's PM QoS request, or a spinner per CPU), so an A/B
# toggles it around each run on the same worker(s): bench/cpu_hold.py, the variants'
# sys.hold (bench/replay_ab.py, bench/service_t1ab.py) and bench/replay_echo.py --hold.
#   off       nothing held (the tree's defaults)
#   dma       /dev/cpu_dma_latency held at 0 us (cpuidle, where there is a driver, picks only
#             exit-latency-0 states: polling)
#   idlespin  a SCHED_IDLE busy loop per CPU (no cpuidle needed: the lever where the file is
#             missing or does nothing)
#   haltpoll  the haltpoll governor's poll ceiling (guest_halt_poll_ns, a KVM guest's) at 1 ms
#             for the run, put back after: idle CPUs poll adaptively before halting
# Each run logs the cpuidle states' entries / time summed over the CPUs during its hold.
# A: what this machine shows (the file, the cpuidle driver, governor and states, haltpoll's
#    parameters); then (1) the held echo of session 28 bundle D (the replay's 113 calls at S=8,
#    each held for the worker's handler p50 per role), off against HOLD, alternated; (2) the
#    28-layer replay (multi, top-64, f16) S=1 and S=8 on one worker, off / HOLD / haltpoll
#    alternated; (3) T1 (bench/service_t1ab.py) on one worker, off against HOLD alternated.
#   PHASE=a bash bench/gpu_t1_s29.sh   env: BOUND (100), BACKEND (cuda), LAYERS (28), SCALE (1),
#     HOLD (auto: dma where the file is writable, else idlespin), EORDER, RORDER, TORDER,
#     SEQS (1,8), RSECONDS (1.0), ESECONDS (0.4), SECONDS_RUN (0.8), ROW_SCALE (1: T1's rows)
# B: bundle A's H200 has no cpuidle driver ("none": an idle vCPU halts; /dev/cpu_dma_latency
#    and haltpoll's ceiling govern nothing there, and A's dma runs were an A/A: T1 245.7 vs
#    223.5, S=1 48.9 vs 37.0, S=8 72.8 vs 77.5, echo the same). The lever left inside the guest:
#    keep the vCPUs from halting, a SCHED_IDLE spinner per CPU (idlespin; sessions 11-12 saw it
#    lower T1 and its floor alike). B measures it where no floor was measured under it: (1) the
#    held echo (bare = the replay's floor; held = its surcharge) off / BHOLD, (2) the replay S=1,
#    8, 64 on one worker off / BHOLD alternated, (3) T1 off / BHOLD on one worker, each run's
#    busy-polling echo floor measured inside its hold (--floor-each).
#   PHASE=b bash bench/gpu_t1_s29.sh   env: BOUND (100), BACKEND, LAYERS, SCALE, ROW_SCALE,
#     BHOLD (idlespin), EORDER ("off BHOLD"), RORDER, SEQS (1,8,64), RSECONDS (1.0), TORDER,
#     SECONDS_RUN (0.8), ESECONDS (0.4)
# C: bundle B's replay gain from the spinners (idlespin) in more pairs: the replay S=8 and S=1 on one
#    worker, off / idlespin alternated (B: S=8 84.3 -> 77.2, S=1 45.3 -> 43.1, S=64 343.9 ->
#    313.1 ms; 1-2 runs each).
#   PHASE=c bash bench/gpu_t1_s29.sh   env: BOUND (60), BACKEND, LAYERS, SCALE, CORDER,
#     SEQS (8,1), RSECONDS (0.8)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/t1"
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-100}
  {
    python3 bench/cpu_hold.py
    for f in /sys/module/haltpoll/parameters/* /sys/devices/system/cpu/cpuidle/available_governors; do
      [[ -r $f ]] && echo "$f = $(cat "$f")"
    done
    uname -r
    echo "cmdline: $(cat /proc/cmdline)"
    echo "modules: $(ls /sys/module | grep -iE 'haltpoll|cpuidle|intel_idle|acpi' | tr '\n' ' ')"
    echo "dmesg: $(dmesg 2>/dev/null | grep -iE 'haltpoll|cpuidle|poll_control' \
      | grep -vi 'command line' | head -3 | tr '\n' ' ')"
  } >"$OUT/probe.log" 2>&1
  sed 's/^/# /' "$OUT/probe.log"
  hold=${HOLD:-auto}
  if [[ $hold == auto ]]; then
    drv=$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)
    [[ -w /dev/cpu_dma_latency && $drv != none ]] && hold=dma || hold=idlespin
  fi
  echo "# HOLD=$hold"
  holds="8:q+k+v=270.7,o=156.7,gate+up=263.7,down=259.8,lm_head=356.1"
  # (1) the held echo: a call each, off / hold alternated
  i=0
  for h in ${EORDER:-off $hold $hold off}; do
    i=$((i + 1))
    [[ $h == off ]] && ha="" || ha=$h
    if left 14; then
      step "echo${i}_$h" "$(bound 20 1)" python3 bench/replay_echo.py --seqs 8 \
        --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds "$holds" --hold-sides server \
        --seconds "${ESECONDS:-0.4}" --hold "$ha" --json "$OUT/echo${i}_$h.json"
    fi
  done
  # (2) the replay, one worker, the holds alternated around its runs
  if left 40; then
    step replay "$(bound 1000 24)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
      --variants "off:host.precision=f16 $hold:host.precision=f16,sys.hold=$hold \
haltpoll:host.precision=f16,sys.hold=haltpoll" \
      --order "${RORDER:-off,$hold,haltpoll,haltpoll,$hold,off,off,$hold,haltpoll}" \
      --seqs "${SEQS:-1,8}" --seconds "${RSECONDS:-1.0}" --warmup 0.4 \
      --bound "$(($(bound 1000 25) - 1))" --out-dir "$OUT" --json "$OUT/replay.json"
  else
    note "# replay not run at $(elapsed) (bound $BOUND s)"
  fi
  # (3) T1 on one worker (its first: no spare, both variants on it), off / hold alternated
  if left 14; then
    step t1ab "$(bound 1000 1)" python3 bench/service_t1ab.py --backend "${BACKEND:-cuda}" \
      --variants "off: $hold:sys.hold=$hold" --no-spare \
      --order "${TORDER:-off,$hold,$hold,off,off,$hold,$hold,off}" \
      --seconds "${SECONDS_RUN:-0.8}" --warmup 0.3 --row-scale "${ROW_SCALE:-1}" \
      --bound "$(($(bound 1000 2) - 1))" --out-dir "$OUT" --json "$OUT/t1ab.json"
  fi
  {
    echo "# gpu_t1_s29 PHASE=$PHASE $(tree_commit) total $(elapsed) HOLD=$hold"
    steps
    machine_summary
    sed 's/^/# probe /' "$OUT/probe.log" | cut -c1-300
    grep -hE "FAILED|skipped|failed" "$OUT"/*.log | cut -c1-200
    for f in "$OUT"/echo*.log; do
      [[ -f $f ]] && grep -E "^(# replay echo|# hold|S=)" "$f" | cut -c1-200 \
        | sed "s/^/$(basename "$f" .log) /"
    done
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
    [[ -f $OUT/t1ab.log ]] && grep -E "hold|^# T1|median" "$OUT/t1ab.log" | cut -c1-400
    [[ -f $OUT/t1ab.log ]] && sed -n '/^# T1 A\/B/,$p' "$OUT/t1ab.log" | cut -c1-400
  } | table
fi
if [[ $PHASE == b ]]; then
  BOUND=${BOUND:-100}
  bh=${BHOLD:-idlespin}
  python3 bench/cpu_hold.py | sed 's/^/# /'
  holds="8:q+k+v=270.7,o=156.7,gate+up=263.7,down=259.8,lm_head=356.1"
  i=0
  for h in ${EORDER:-off $bh}; do
    i=$((i + 1))
    [[ $h == off ]] && ha="" || ha=$h
    if left 70; then
      step "echo${i}_$h" "$(bound 20 1)" python3 bench/replay_echo.py --seqs 8 \
        --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds "$holds" --hold-sides server \
        --seconds "${ESECONDS:-0.4}" --hold "$ha" --json "$OUT/echo${i}_$h.json"
    fi
  done
  if left 40; then
    step replay "$(bound 1000 24)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
      --variants "off:host.precision=f16 $bh:host.precision=f16,sys.hold=$bh" \
      --order "${RORDER:-off,$bh,$bh,off,off,$bh,$bh,off}" \
      --seqs "${SEQS:-1,8,64}" --seconds "${RSECONDS:-1.0}" --warmup 0.4 \
      --bound "$(($(bound 1000 25) - 1))" --out-dir "$OUT" --json "$OUT/replay.json"
  else
    note "# replay not run at $(elapsed) (bound $BOUND s)"
  fi
  if left 14; then
    step t1ab "$(bound 1000 1)" python3 bench/service_t1ab.py --backend "${BACKEND:-cuda}" \
      --variants "off: $bh:sys.hold=$bh" --no-spare --floor-each 0.5 \
      --order "${TORDER:-off,$bh,$bh,off,off,$bh,$bh,off}" \
      --seconds "${SECONDS_RUN:-0.8}" --warmup 0.3 --row-scale "${ROW_SCALE:-1}" \
      --bound "$(($(bound 1000 2) - 1))" --out-dir "$OUT" --json "$OUT/t1ab.json"
  fi
  {
    echo "# gpu_t1_s29 PHASE=$PHASE $(tree_commit) total $(elapsed) BHOLD=$bh"
    steps
    machine_summary
    grep -hE "FAILED|skipped|failed" "$OUT"/*.log | cut -c1-200
    for f in "$OUT"/echo*.log; do
      [[ -f $f ]] && grep -E "^(# replay echo|# hold|S=)" "$f" | cut -c1-200 \
        | sed "s/^/$(basename "$f" .log) /"
    done
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
    [[ -f $OUT/t1ab.log ]] && sed -n '/^# T1 A\/B/,$p' "$OUT/t1ab.log" | cut -c1-400
  } | table
fi
if [[ $PHASE == c ]]; then
  BOUND=${BOUND:-60}
  step replay "$(bound 1000 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
    --variants "off:host.precision=f16 idlespin:host.precision=f16,sys.hold=idlespin" \
    --order "${CORDER:-off,idlespin,idlespin,off,off,idlespin,idlespin,off,off,idlespin}" \
    --seqs "${SEQS:-8,1}" --seconds "${RSECONDS:-0.8}" --warmup 0.3 \
    --bound "$(($(bound 1000 3) - 1))" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# gpu_t1_s29 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "FAILED|failed" "$OUT"/*.log | cut -c1-200
    [[ -f $OUT/replay.log ]] && grep -E "^# (off|idlespin)_[0-9]+ S=" "$OUT/replay.log" \
      | cut -c1-120
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-700
  } | table
fi
exit 0
