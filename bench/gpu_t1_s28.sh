#!/usr/bin/env bash
# t1's device script, session 27 (issue 14: T1's server_decode / server_other; the replay's
# S=1 multi-vs-single worker window).
# A: T1 (one caller, N=1 f16 ffn_down, MatmulStream, f32 y) with this tree's worker against
#    main 6fb1383's (`main`: this tree with service/wire.py as it was there, shipped as
#    bench/gpu_t1_s27.wire_main.txt; this tree's worker-side changes are all in wire.py: the
#    request skeletons, the reply writer's kept head), alternated by bench/service_t1ab.py
#    (one worker per variant, ffn_down uploaded once, each run's load its own process; the
#    busy-polling echo of T1's sizes first). Then
#    the 28-layer replay at S=1 with multi-weight calls (mul) and without (one), alternated on
#    this tree's one worker by bench/replay_ab.py (host.multi), for the per-call table.
#   PHASE=a bash bench/gpu_t1_s27.sh   env: BOUND (100), BACKEND (cuda), ORDER, SECONDS_RUN (0.8),
#     ROW_SCALE (1), LAYERS (28), SCALE (1), RORDER, RVARIANTS, SEQS (1)
# B: T1's A/B again, the order mirrored (new first) and two workers of each tree (main2, new2:
#    an A/A beside it, 4 runs each), then the 28-layer replay (multi-weight,
#    top-64, f16) at S=1 and S=8 with this tree's worker against main's (the same base as T1's),
#    alternated by bench/replay_ab.py (a worker each, the model uploaded to both at once).
#   PHASE=b bash bench/gpu_t1_s27.sh   env: as A (RORDER: new,main,main,new; SEQS: 1,8)
#   Bundle A (H200, tree 5a1dbfd: the small requests' skeletons only): T1 p50 - kernel median
#   of 6 runs 342.8 (main) -> 234.0 us (new), server decode 28.9 -> 11.7 (mean of runs'
#   means); the replay S=1 mul 47.71 / one 57.10 ms a step (3 runs each).
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
  # (the base's wire.py lives on branch wt-t1 only: a copy of a product file stays off main)
  if [[ -f bench/gpu_t1_s27.wire_main.txt ]]; then
    cp bench/gpu_t1_s27.wire_main.txt "$base/service/wire.py"
  else
    echo "# no bench/gpu_t1_s27.wire_main.txt: main and new run the same wire.py"
  fi
  base_tree "$base"
  PYTHONPATH=$BASEPP python3 -c "import q6serve.service.wire as w; print('# main wire has \
skeletons:', hasattr(w, 'MatmulSeen'))"
  python3 -c "import q6serve.service.wire as w; print('# this wire has skeletons:', \
hasattr(w, 'MatmulSeen'))"
  if [[ $PHASE == a ]]; then
    order=main,new,new,main,main,new,new,main,main,new,new,main
    rorder=one,mul,mul,one,one,mul
    rvariants="mul:host.multi=on,host.precision=f16 one:host.multi=off,host.precision=f16"
    seqs=1
    t1end=$(bound 62 30)  # T1 first, its own bound (the replay's worker and upload ~17 s)
  else
    # two workers of each tree (main2, new2: the same code in another process, an A/A beside
    # the A/B: bundle A's runs of main were slower in every part, the caller's own included)
    order=new,main,main2,new2,new2,main2,main,new,new,main,main2,new2,new2,main2,main,new
    rorder=new,main,main,new
    rvariants="main:PYTHONPATH=$BASEPP,host.precision=f16 new:host.precision=f16"
    seqs=1,8
    t1end=$(bound 44 50)  # (12 runs and 2 workers took 34 s in bundle A)
  fi
  t1variants="main:PYTHONPATH=$BASEPP new:"
  [[ $PHASE == b ]] && t1variants="$t1variants main2:PYTHONPATH=$BASEPP new2:"
  step t1ab "$t1end" python3 bench/service_t1ab.py --backend "${BACKEND:-cuda}" \
    --variants "${T1VARIANTS:-$t1variants}" --order "${ORDER:-$order}" \
    --seconds "${SECONDS_RUN:-0.8}" --warmup 0.3 --row-scale "${ROW_SCALE:-1}" --floor \
    --bound "$((t1end - 2))" --out-dir "$OUT" --json "$OUT/t1ab.json"
  rest=$(($(bound 1000 6) - 1))
  if left 25; then
    step replay "$(bound 60 4)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
      --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
      --variants "${RVARIANTS:-$rvariants}" \
      --order "${RORDER:-$rorder}" --seqs "${SEQS:-$seqs}" --seconds 1.0 --warmup 0.4 \
      --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  else
    note "# replay not run at $(elapsed) (bound $BOUND s)"
  fi
  {
    echo "# gpu_t1_s27 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "skeletons|FAILED|skipped" "$OUT"/*.log | cut -c1-200
    sed -n '/^# T1 A\/B/,$p' "$OUT/t1ab.log" | cut -c1-400
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
  } | table
fi
if [[ $PHASE == d ]]; then
  # D: the replay's caller decoding its replies (issue 14, the caller's CPU at S=8: client 8.32
  # ms a step in main 1290b84's closing check, of which gate+up's 606 KB reply ~120 us a call):
  # upb and the arrays (arr: bench/service.py --replay's host up to main 1290b84, y copied twice)
  # against the q6serve client's own stream decoding (cli: core.stream_outcome, what
  # Client.matmul_stream yields: replies >= 256 KiB read as views, every MatmulOutput field) and
  # the client's views from 32 KiB (v32: client/reply_bytes.VIEW_MIN=32768, every S=8 y reply
  # but lm-head's top-k), alternated on one worker (main's code), 28 layers, multi-weight,
  # top-64, f16, S=8 and S=1 (at S=1 every reply is under 256 KiB: the client's decoding
  # without views, every MatmulOutput field, against upb and y alone), 1 s a run (arr 6
  # runs, cli 6, v32 3); the first run (v32) also compiles the kernels.
  #   PHASE=d bash bench/gpu_t1_s27.sh   env: BOUND (100), BACKEND (cuda), LAYERS (28), SCALE (1),
  #     RORDER, RVARIANTS, SEQS (8,1), RSECONDS (1.0)
  BOUND=${BOUND:-100}
  rorder=v32,arr,cli,cli,arr,v32,arr,cli,cli,arr,v32,arr,cli,cli,arr
  rvariants="arr:host.decode=arrays,host.precision=f16 cli:host.decode=client,host.precision=f16"
  rvariants="$rvariants v32:host.decode=client,host.view_min=32768,host.precision=f16"
  rest=$(($(bound 1000 6) - 1))
  step replay "$(bound 1000 4)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" \
    --variants "${RVARIANTS:-$rvariants}" \
    --order "${RORDER:-$rorder}" --seqs "${SEQS:-8,1}" --seconds "${RSECONDS:-1.0}" --warmup 0.4 \
    --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# gpu_t1_s27 PHASE=$PHASE $(tree_commit) total $(elapsed)"
    steps
    machine_summary
    grep -hE "FAILED|skipped" "$OUT"/*.log | cut -c1-200
    [[ -f $OUT/replay.log ]] && sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" | cut -c1-900
  } | table
fi
exit 0
