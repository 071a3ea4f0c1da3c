#!/usr/bin/env bash
# t1's device script, session 24 (issue 14: T1 and the replay); PHASE=a (bundle B, bound 70 s).
# A: gRPC's EventEngine experiments off against gRPC's defaults (goal 1: the thread hops of a
#    round trip). grpcio 1.8x polls its sockets on the EventEngine (its own poller and thread
#    pool) unless GRPC_EXPERIMENTS turns the event_engine_* experiments off, which gives back
#    the older iomgr path: the thread that waits on the completion queue polls the socket
#    itself. VM (2 cores, numpy): bench/stream_overhead.py at T1's sizes, 3 rounds alternated,
#    bare echo 238 -> 169 us p50 (its EventEngine threads' 3 wake-ups and 50 us of CPU a round
#    trip gone), the worker 744 -> 704 beyond its kernel (its EventEngine threads 10.8
#    wake-ups and 209 us of CPU a round trip -> 3.4 and 69). Here: (1) the same on the CUDA
#    worker, the servers' environments alternated in one process (bare, bareee, worker,
#    workeree: rounds in turn, the caller on gRPC's defaults), (2) T1 as the closing check
#    runs it (bench/service.py --target-report --targets T1) with the experiments off in every
#    process (worker, its floors' echoes and callers), if the bound leaves time; the machine
#    probed first (bench/machine_probe.py: each core's speed).
#   PHASE=a bash bench/gpu_t1_s24.sh   env: BOUND, BACKEND (cuda), ROUNDS (4), SECONDS_RUN (0.6)
# B: T1 as the closing check runs it on the tree where `q6serve worker` turns the EventEngine
#    off itself (client/grpc_env.py) and the floors' echoes run as the worker (bench/
#    service_load.py), the caller on gRPC's defaults (bundle C, bound 50 s; A's t1_ee was cut
#    at its 17 s step); then, if the bound leaves time, with GRPC_EXPERIMENTS empty (gRPC's
#    defaults in every process: main's T1).
#   PHASE=b bash bench/gpu_t1_s24.sh   env: BOUND, BACKEND (cuda)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/t1"
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-70}
  EE_OFF=$(cd bench && python3 -c "import stream_overhead as s; print(s.EE_OFF)")
  step probe 6 python3 bench/machine_probe.py --label start --json "$OUT/probe.json"
  # gRPC's version, and whether it knows every experiment named (else it logs "Unknown")
  step grpc 8 env "GRPC_EXPERIMENTS=$EE_OFF" python3 -c "import grpc; print('grpc', grpc.__version__)"
  # (1): one worker and one echo per environment, started once, rounds alternated (the
  # first worker's start compiles the kernels if no earlier script of the call did)
  step overhead "$(bound 45 14)" env -C bench python3 stream_overhead.py --backend "${BACKEND:-cuda}" \
    --variants bare,bareee,worker,workeree --rounds "${ROUNDS:-4}" --seconds "${SECONDS_RUN:-0.6}" \
    --warmup 0.2 --inproc 0 --rows 3584 --out f32
  # (2): T1 with the experiments off everywhere (0.8 s timed: it must fit what is left)
  if left 13; then
    step t1_ee "$(bound 17 1)" env "GRPC_EXPERIMENTS=$EE_OFF" python3 bench/service.py \
      --backend "${BACKEND:-cuda}" --target-report --targets T1 --modes stream \
      --weights ffn_down --seconds 0.8 --warmup 0.2 --json "$OUT/t1_ee.json"
  else
    note "# t1_ee skipped at $(elapsed)"
  fi
  {
    echo "# gpu_t1_s24 PHASE=a $(tree_commit) total $(elapsed); ee: GRPC_EXPERIMENTS=$EE_OFF"
    steps
    machine_summary
    grep -hE "^probe " "$OUT/probe.log"
    grep -hE "^grpc|Unknown experiment" "$OUT/grpc.log" | head -5 | cut -c1-160
    grep -E "^# round|^(bare|bareee|worker|workeree) |^ +threads" "$OUT/overhead.log" | cut -c1-220
    [[ -f $OUT/t1_ee.log ]] && grep -hE "^T1 |mean us|bare gRPC round trip|MISSED|met$" \
      "$OUT/t1_ee.log" | cut -c1-220
  } | table
elif [[ $PHASE == b ]]; then
  BOUND=${BOUND:-50}
  t1() {  # RUN [VAR=VALUE]: T1 as bench/gpu_check.sh runs it
    local run=$1
    shift
    step "$run" "$(bound 32 1)" env "$@" python3 bench/service.py --backend "${BACKEND:-cuda}" \
      --target-report --targets T1 --modes stream --weights ffn_down --seconds 1.0 \
      --warmup 0.3 --json "$OUT/$run.json"
  }
  t1 t1_new
  if left 16; then t1 t1_grpcdef GRPC_EXPERIMENTS=; else note "# t1_grpcdef skipped at $(elapsed)"; fi
  {
    echo "# gpu_t1_s24 PHASE=b $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    for r in t1_new t1_grpcdef; do
      [[ -f $OUT/$r.log ]] || continue
      echo "## $r"
      grep -hE "^T1 |mean us|bare gRPC round trip|MISSED|met$" "$OUT/$r.log" | cut -c1-220
    done
    grep -hE "gRPC: GRPC_EXPERIMENTS" "$OUT/worker.log" | cut -c1-200
  } | table
fi
exit 0
