#!/usr/bin/env bash
# t1's device script, session 28 (issue 14, ask 1: the worker's Python window per call; ask 2:
# the transport's surcharge at S=8; ask 3: T1 robust).
# new: the batch stats once a loop trip and the multi-weight launch function kept (engine.py,
# batcher.py), and (bundles A-C only; reverted after C lost on T1, 7 of 8 pairs) a direct
# reply's write not waited for before the next read (servicer.py: mid = without it).
# The base ("main") is this tree with the product files this branch changed as they are on
# main 1e0f9dc: copies shipped as bench/t1_s28_base/<file>.py.txt (service/<file>.py), on
# branch wt-t1 only; without them main and new run the same code (said so).
# A: (1) bench/replay_inproc_ab.py: the worker's Python per call of each replay role in
#    process over the no-op backend (no GPU, this host's CPU), S=8, main against new,
#    alternated, a process a run; (2) the 28-layer replay (multi-weight, top-64, f16) at S=1
#    and S=8 with this tree's worker against main's, alternated by bench/replay_ab.py (a
#    worker each, the model uploaded to both at once), and on new's worker the replay's host
#    busy-polling HSPIN us (2000: longer than a call; "spin") as the bare floor's caller does
#    (ask 2: is the surcharge over that floor the caller's wake-ups?); (3) ask 2: bench/replay_echo.py, the
#    replay's calls against a busy-polling echo: bare, held by the echo for new's handler
#    window per role (the replay's JSON), and held as long by the caller before each write;
#    then (echo_ahead) held by an echo that reads each next request before its reply's write
#    completes, as new's worker does (servicer.start_now).
#   PHASE=a bash bench/gpu_t1_s28.sh   env: BOUND (100), BACKEND (cuda), LAYERS (28),
#     SCALE (1), IORDER, RORDER, SEQS (1,8), RSECONDS (1.0), ECHO_S (24), ESEQS (8,1),
#     ESECONDS (0.5), HSPIN (2000), ESPIN (0: the echo's caller's loop busy-polls ESPIN us)
# B: T1 A/B (bench/service_t1ab.py, ask 3): main, mid (new with main's servicer.py: no
#    read-ahead) and new, a worker each, alternated; then the replay at S=8 and S=1 on new's
#    one worker with host-side variants (ask 2): the host plain (new), busy-polling HSPIN us
#    (spin), reading each reply before its write completes (ah: host.ahead=on), both (sah).
#   PHASE=b bash bench/gpu_t1_s28.sh   env: BOUND (100), BACKEND, LAYERS, SCALE, ORDER,
#     SECONDS_RUN (0.8), RORDER, SEQS (8: bundle A's spin moved S=8 only), RSECONDS (1.0),
#     HSPIN (2000)
# C: T1 A/B of mid (no read-ahead) against new, two workers each, 16 runs alternated.
#   PHASE=c bash bench/gpu_t1_s28.sh   env: BOUND (70), BACKEND, ORDER, SECONDS_RUN (0.8)
# D: bundle A's held echo (either side) with the caller asleep and busy-polling 2000 us.
#   PHASE=d bash bench/gpu_t1_s28.sh   env: BOUND (40), HOLDS, DSPINS ("0 2000"), ESEQS (8),
#     LAYERS (28), SCALE (1), ESECONDS (0.5)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/t1"
if [[ $PHASE == a || $PHASE == b ]]; then
  BOUND=${BOUND:-100}
  base=/tmp/t1base_$$
  rm -rf "$base" && mkdir -p "$base"
  cp -r kernels service client proto "$base/"
  shipped=0
  for f in bench/t1_s28_base/*.py.txt; do
    [[ -f $f ]] || continue
    b=$(basename "$f" .txt)
    cp "$f" "$base/service/$b"
    shipped=$((shipped + 1))
    echo "# base service/$b from $f"
  done
  ((shipped)) || echo "# no bench/t1_s28_base/*.py.txt: main and new run the same code"
  base_tree "$base"
fi
if [[ $PHASE == a ]]; then
  ECHO_S=${ECHO_S:-24}  # seconds kept for the held echoes after the replay
  iorder=main,new,new,main,main,new,new,main
  rorder=main,new,spin,spin,new,main,main,new,spin,spin,new,main
  iend=$(bound 16 50)
  step inproc "$iend" python3 bench/replay_inproc_ab.py \
    --variants "main:PYTHONPATH=$BASEPP new:" --order "${IORDER:-$iorder}" --seqs 8 \
    --calls 300 --rounds 3 --bound "$((iend - 3))" --out-dir "$OUT" --json "$OUT/inproc.json"
  rest=$(($(bound 1000 "$ECHO_S") - 1))
  if left $((30 + ECHO_S)); then
    step replay "$(bound 1000 "$((ECHO_S - 2))")" python3 bench/replay_ab.py \
      --backend "${BACKEND:-cuda}" --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
      --variants "main:PYTHONPATH=$BASEPP,host.precision=f16 new:host.precision=f16 \
spin:host.precision=f16,host.spin=${HSPIN:-2000}" \
      --order "${RORDER:-$rorder}" --seqs "${SEQS:-1,8}" --seconds "${RSECONDS:-1.0}" \
      --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  else
    note "# replay not run at $(elapsed) (bound $BOUND s)"
  fi
  # ask 2: the transport's surcharge: the replay's calls against a busy-polling echo, bare,
  # held by the echo for the worker's handler window (new's runs above: p50 per role), and
  # held as long by the caller before it writes (the echo answering at once)
  if [[ -f $OUT/replay.json ]] && left 12; then
    step echo "$(bound 40 1)" python3 bench/replay_echo.py --seqs "${ESEQS:-8,1}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds-from "$OUT/replay.json" \
      --holds-variant new --hold-fields handler --hold-sides server,client \
      --seconds "${ESECONDS:-0.5}" --spin "${ESPIN:-0}" --json "$OUT/echo.json"
  fi
  # the same, the echo reading each next request before its reply's write completes (as
  # new's worker does: servicer.start_now), held by the echo only
  if [[ -f $OUT/replay.json ]] && left 8; then
    step echo_ahead "$(bound 30 1)" python3 bench/replay_echo.py --seqs "${ESEQS:-8,1}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds-from "$OUT/replay.json" \
      --holds-variant new --hold-fields handler --hold-sides server --ahead \
      --seconds "${ESECONDS:-0.5}" --spin "${ESPIN:-0}" --json "$OUT/echo_ahead.json"
  fi
  {
    echo "# gpu_t1_s28 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "^# base|same code|FAILED|skipped|failed" "$OUT"/*.log | cut -c1-200
    [[ -f $OUT/t1ab.log ]] && sed -n '/^# T1 A\/B/,$p' "$OUT/t1ab.log" | cut -c1-400
    sed -n '/^# replay_inproc A\/B/,$p' "$OUT/inproc.log" | cut -c1-300
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
    [[ -f $OUT/echo.log ]] && grep -E "^(# |S=)" "$OUT/echo.log" | cut -c1-300
    [[ -f $OUT/echo_ahead.log ]] && grep -E "^(# |S=)" "$OUT/echo_ahead.log" | cut -c1-300 \
      | sed 's/^/ahead /'
  } | table
fi
if [[ $PHASE == b ]]; then
  # mid: this tree with main's servicer.py (no read-ahead): a PYTHONPATH of its own
  mid=/tmp/t1mid_$$
  rm -rf "$mid" && mkdir -p "$mid/q6serve"
  cp -r kernels service client "$mid/q6serve/"
  cp -r proto/q6serve/v1 "$mid/q6serve/v1"
  if [[ -f bench/t1_s28_base/servicer.py.txt ]]; then
    cp bench/t1_s28_base/servicer.py.txt "$mid/q6serve/service/servicer.py"
  else
    echo "# no bench/t1_s28_base/servicer.py.txt: mid runs new's servicer"
  fi
  MIDPP="$mid${NOWPP:+:$NOWPP}"
  PYTHONPATH=$MIDPP python3 -c "import q6serve.service.servicer as s; print('# mid code', \
s.__file__, 'reads ahead:', hasattr(s, 'start_now'))"
  t1end=$(bound 36 50)
  step t1ab "$t1end" python3 bench/service_t1ab.py --backend "${BACKEND:-cuda}" \
    --variants "main:PYTHONPATH=$BASEPP mid:PYTHONPATH=$MIDPP new:" \
    --order "${ORDER:-new,mid,main,main,mid,new,new,mid,main}" \
    --seconds "${SECONDS_RUN:-0.8}" --warmup 0.3 --row-scale 1 --floor \
    --bound "$((t1end - 2))" --out-dir "$OUT" --json "$OUT/t1ab.json"
  # host-side variants on new's one worker (one upload): the host busy-polling HSPIN us
  # (bundle A: S=8 77.5 against 88.3 ms, two runs each), reading ahead of its writes, both
  if left 30; then
    step replay "$(bound 1000 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
      --variants "new:host.precision=f16 spin:host.precision=f16,host.spin=${HSPIN:-2000} \
ah:host.precision=f16,host.ahead=on sah:host.precision=f16,host.ahead=on,host.spin=${HSPIN:-2000}" \
      --order "${RORDER:-new,spin,ah,sah,sah,ah,spin,new,new,spin,ah,sah}" \
      --seqs "${SEQS:-8}" --seconds "${RSECONDS:-1.0}" --warmup 0.4 \
      --bound "$(($(bound 1000 3) - 1))" --out-dir "$OUT" --json "$OUT/replay.json"
  else
    note "# replay not run at $(elapsed) (bound $BOUND s)"
  fi
  {
    echo "# gpu_t1_s28 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "^# (base|mid)|same code|FAILED|skipped|failed" "$OUT"/*.log | cut -c1-200
    [[ -f $OUT/t1ab.log ]] && sed -n '/^# T1 A\/B/,$p' "$OUT/t1ab.log" | cut -c1-400
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
  } | table
fi
if [[ $PHASE == c ]]; then
  # C: T1 A/B of mid (this tree with main's servicer.py: the direct reply's write waited for
  # before the next read) against new (the next read posted while the write completes), two
  # workers each, alternated (bundle B's T1 did not resolve it: medians mid 307.6, new 400.1,
  # main 378.7 us on a slow host, echo 177 us, runs 249-442)
  BOUND=${BOUND:-70}
  mid=/tmp/t1mid_$$
  rm -rf "$mid" && mkdir -p "$mid/q6serve"
  cp -r kernels service client "$mid/q6serve/"
  cp -r proto/q6serve/v1 "$mid/q6serve/v1"
  if [[ -f bench/t1_s28_base/servicer.py.txt ]]; then
    cp bench/t1_s28_base/servicer.py.txt "$mid/q6serve/service/servicer.py"
  else
    echo "# no bench/t1_s28_base/servicer.py.txt: mid runs new's servicer"
  fi
  MIDPP="$mid${PYTHONPATH:+:$PYTHONPATH}"
  PYTHONPATH=$MIDPP python3 -c "import q6serve.service.servicer as s; print('# mid code', \
s.__file__, 'reads ahead:', hasattr(s, 'start_now'))"
  t1end=$(bound 1000 3)
  step t1ab "$t1end" python3 bench/service_t1ab.py --backend "${BACKEND:-cuda}" \
    --variants "mid:PYTHONPATH=$MIDPP new: mid2:PYTHONPATH=$MIDPP new2:" \
    --order "${ORDER:-new,mid,mid2,new2,new2,mid2,mid,new,mid,new,new2,mid2,mid2,new2,new,mid}" \
    --seconds "${SECONDS_RUN:-0.8}" --warmup 0.3 --row-scale 1 --floor \
    --bound "$((t1end - 2))" --out-dir "$OUT" --json "$OUT/t1ab.json"
  {
    echo "# gpu_t1_s28 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "^# mid|FAILED|skipped|failed" "$OUT"/*.log | cut -c1-200
    [[ -f $OUT/t1ab.log ]] && sed -n '/^# T1 A\/B/,$p' "$OUT/t1ab.log" | cut -c1-400
  } | table
fi
if [[ $PHASE == d ]]; then
  # D (ask 2): the held echo of bundle A (the replay's 113 calls, each held for new's handler
  # p50 per role, by the echo or by the caller) with the caller's loop asleep between its write
  # and the reply (spin 0, as the replay's aio host) and busy-polling 2000 us: if the echo-held
  # surcharge goes with the caller's spin, it is the caller's wake-up.
  BOUND=${BOUND:-40}
  holds=${HOLDS:-"8:q+k+v=270.7,o=156.7,gate+up=263.7,down=259.8,lm_head=356.1;\
1:q+k+v=184.2,o=98.0,gate+up=192.0,down=120.1,lm_head=286.2"}
  for sp in ${DSPINS:-0 2000}; do
    step "echo_s$sp" "$(bound 30 1)" python3 bench/replay_echo.py --seqs "${ESEQS:-8}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds "$holds" \
      --hold-sides server,client --seconds "${ESECONDS:-0.5}" --spin "$sp" \
      --json "$OUT/echo_s$sp.json"
  done
  {
    echo "# gpu_t1_s28 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    for f in "$OUT"/echo_s*.log; do
      grep -E "^(# |S=)" "$f" | cut -c1-300 | sed "s/^/$(basename "$f" .log) /"
    done
  } | table
fi
exit 0
