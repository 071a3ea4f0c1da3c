#!/usr/bin/env bash
# t1's device script, session 23 (issue 14: the caller's side, T1 and the decode replay);
# PHASE=a (bundle A, bound 75 s), b (B, 70 s), c (C, 60 s).
# A: the 28-layer replay A/B that session 22 lacked (its default replay host changed from grpc.aio
#    on a sleeping loop to Client.session() spinning 2000 us on 4-layer A/Bs only): S=8 (the
#    target), multi-weight calls, alternated on one worker with its replies stamped (bench/
#    replay_ab.py: the model uploaded once): aio = grpc.aio's MatmulStream on the host's loop,
#    arrays decoding (session 21's check host); ss = Client.session() as the product runs it
#    (the check's host since session 22), a b b a. Then the step's floor (bench/replay_echo.py,
#    no worker): the same calls against a bare echo, and against one holding each call for the
#    worker's kernel and for its handler window (ss's medians): what the transport costs with a
#    worker's windows, beside the replay's own round trip per role.
#   PHASE=a bash bench/gpu_t1_s23.sh   env: BOUND, VARIANTS, ORDER, SEQS (8), BACKEND (cuda),
#   LAYERS (28), SCALE (1), SECONDS_RUN (1.5)
# B: T1's first run on a fresh machine (goal 3; this script first in its call): the machine
#    probed (bench/machine_probe.py: each core's speed, a page's first touch, a process wake-up)
#    at the start and the end; T1 as the closing check runs it (1 s timed) three times: first,
#    again (CuPy's kernel cache on disk filled by the first), with glibc's heap-top trim at
#    256 MiB in every process (GLIBC_TUNABLES), and with an empty kernel cache (CUPY_CACHE_DIR:
#    the first run's compiles again on an older machine); during each, where
#    every busy python thread ran (bench/psr_watch.py: the worker's loop and the caller on one
#    CPU?).
#   PHASE=b bash bench/gpu_t1_s23.sh   env: BOUND, BACKEND (cuda), T1_SECONDS (1)
# C: A's A/B again (goal 1: A's first pair mixed the session with the fresh machine's first
#    minute) beside a worker variant (goal 2): aio, ss as in A, mt = aio against a second
#    worker whose glibc malloc keeps its heap's free top up to 256 MiB (GLIBC_TUNABLES trim
#    threshold: a large reply's bytes are not faulted in anew each call), alternated aio,
#    mt, ss, ss, mt, aio, 2 s runs, every busy python thread watched meanwhile
#    (bench/psr_watch.py: CPUs shared, page faults a second of the workers' and callers').
#   PHASE=c bash bench/gpu_t1_s23.sh   env: BOUND, VARIANTS, ORDER, SEQS (8), BACKEND (cuda),
#   LAYERS (28), SCALE (1), SECONDS_RUN (2.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/t1"
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
STAMPED=(env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1)
ab_grep() {  # replay_ab's table
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED|not run)" \
    "$OUT/$1.log" | cut -c1-400
}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-75}
  limit=$(bound 60 14)
  # replay_ab's own bound: no run starts that would end past it (the worker's stop: 4 s kept)
  step replay_ab "$limit" "${STAMPED[@]}" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --variants "${VARIANTS:-aio: ss:host.transport=session,host.decode=client}" \
    --order "${ORDER:-aio,ss,ss,aio}" --seqs "${SEQS:-8}" --layers "${LAYERS:-28}" \
    --scale "${SCALE:-1}" --seconds "${SECONDS_RUN:-1.5}" --warmup 0.3 \
    --bound "$((limit - 4))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
  # the floor: the caller spinning 2000 us as the session does (like for like)
  step echo "$(bound 14)" python3 bench/replay_echo.py --seqs "${SEQS:-8}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds-from "$OUT/replay_ab.json" \
    --holds-variant ss --hold-fields kernel,handler --transport aio --spin 2000 \
    --seconds 0.8 --json "$OUT/echo.json"
  {
    echo "# gpu_t1_s23 PHASE=a $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -E "^# [0-9]+ workers given" "$OUT/replay_ab.log"
    ab_grep replay_ab
    grep -E "^# replay|^S=" "$OUT/echo.log" | cut -c1-200
  } | table
elif [[ $PHASE == b ]]; then
  BOUND=${BOUND:-70}
  probe() { step "probe_$1" 8 python3 bench/machine_probe.py --label "$1" --json "$OUT/probe_$1.json"; }
  t1() {  # NAME [VAR=VALUE...]: T1 as bench/gpu_check.sh runs it (1 s timed, not 2: three runs
    # fit the bound), every python thread's CPU sampled meanwhile (bench/psr_watch.py)
    local name=$1
    shift
    python3 bench/psr_watch.py --seconds 40 --json "$OUT/psr_$name.json" >"$OUT/psr_$name.log" 2>&1 &
    local w=$!
    step "$name" "$(bound 20 3)" env "$@" python3 bench/service.py --backend "${BACKEND:-cuda}" \
      --target-report --targets T1 --modes stream --weights ffn_down \
      --seconds "${T1_SECONDS:-1}" --warmup 0.3 --json "$OUT/$name.json"
    kill -TERM "$w" 2>/dev/null
    wait "$w"
  }
  probe start
  t1 t1_first  # the machine's first (CuPy's kernel cache empty if this script runs first)
  t1 t1_again  # the kernels cached on disk now
  # glibc's heap top kept up to 256 MiB in every process (the worker fixes only its mmap
  # threshold, so a freed block at its heap's top beyond 128 KiB is handed back and the next
  # one faulted in anew)
  t1 t1_trim GLIBC_TUNABLES=glibc.malloc.trim_threshold=268435456
  mkdir -p /tmp/t1_empty_cache
  t1 t1_cold CUPY_CACHE_DIR=/tmp/t1_empty_cache  # an empty kernel cache again, the machine older
  probe end
  {
    echo "# gpu_t1_s23 PHASE=b $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    for p in start end; do grep -hE "^probe |^# [a-z]+ cpu loop" "$OUT/probe_$p.log"; done
    for r in first again trim cold; do
      echo "## t1_$r"
      grep -hE "^T1 |mean us|bare gRPC round trip(, echo| with)" "$OUT/t1_$r.log" | cut -c1-200
      grep -E "^thread" "$OUT/psr_t1_$r.log" | head -6 | cut -c1-150
      grep -E "^pair" "$OUT/psr_t1_$r.log" | head -6 | cut -c1-150
    done
  } | table
elif [[ $PHASE == c ]]; then
  BOUND=${BOUND:-60}
  # every busy python thread's CPUs and page faults beside the whole A/B (bench/psr_watch.py)
  python3 bench/psr_watch.py --seconds 70 --json "$OUT/psr_replay.json" >"$OUT/psr_replay.log" 2>&1 &
  w=$!
  # glibc's heap top kept up to 256 MiB (the worker fixes its mmap threshold at 32 MiB but not
  # the trim threshold: a freed reply at the heap's top beyond 128 KiB is handed back at once
  # and the next one faulted in anew; its trim loop still hands the free pages back every 5 s)
  TUNE=glibc.malloc.trim_threshold=268435456
  limit=$(bound 57 3)
  step replay_ab "$limit" "${STAMPED[@]}" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --variants "${VARIANTS:-aio: ss:host.transport=session,host.decode=client mt:GLIBC_TUNABLES=$TUNE}" \
    --order "${ORDER:-aio,mt,ss,ss,mt,aio}" --seqs "${SEQS:-8}" --layers "${LAYERS:-28}" \
    --scale "${SCALE:-1}" --seconds "${SECONDS_RUN:-2.0}" --warmup 0.3 \
    --bound "$((limit - 3))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
  kill -TERM "$w" 2>/dev/null
  wait "$w"
  {
    echo "# gpu_t1_s23 PHASE=c $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -E "^# [0-9]+ workers given" "$OUT/replay_ab.log"
    ab_grep replay_ab
    grep -E "^thread" "$OUT/psr_replay.log" | head -12 | cut -c1-150
    grep -E "^pair" "$OUT/psr_replay.log" | head -6 | cut -c1-150
  } | table
fi
exit 0
