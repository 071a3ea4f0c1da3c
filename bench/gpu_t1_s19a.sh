#!/usr/bin/env bash
# t1's bundle A, session 19 (issue 14): (1) T1's floor probe: one caller, MatmulStream, N=1 f16 x
# of K=18944, f32 y of 3584 (T1's sizes) against the busy-polling bare echo (bare+spin), the same
# echo running the least Python a worker needs for the call (bare+spin+job: the request decoded,
# the worker's direct job on the GPU: x staged, the captured launch graph, the wait; the reply
# encoded by wire.stream_reply) and the worker itself (q6serve worker --backend cuda), rounds
# alternated in one process (bench/stream_overhead.py); figures p50 of round trip - kernel: how
# much of T1's ~215 us beyond the echo is ours and how much any Python worker pays. (2) The
# closing check's new order (bench/gpu_check.sh), its targets half under what is left of the
# bound: the steps it cannot fit must read "cut" in its table.
#   bash bench/gpu_t1_s19a.sh   env: BOUND (76 s), ROUNDS (3), PROBE_S (1.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s19a
BOUND=${BOUND:-76}
step probe 40 python3 bench/stream_overhead.py --backend cuda \
  --variants bare+spin,bare+spin+job,worker --rows 3584 --k 18944 --out f32 \
  --rounds "${ROUNDS:-3}" --seconds "${PROBE_S:-1.0}" --warmup 0.3 --inproc 0
# the check in what is left (its own bound 3 s short of ours: its table printed inside it)
rest=$(bound 80 1)
step check "$rest" env SKIP_INSTALL=1 BOUND=$((rest - 3)) RESERVE=5 SKIP_SUITES=1 SKIP_PINNED=1 \
  SKIP_TRIPS=1 SKIP_PROBES=1 REPLAY_SEQS=8 DP_VARIANTS=6rr OUT="$OUT/check" bench/gpu_check.sh
{
  echo "# gpu_t1_s19a $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# round|median|window" "$OUT/probe.log" | cut -c1-260
  sed -n '/^# gpu_check/,$p' "$OUT/check/summary.txt" 2>/dev/null | cut -c1-260
} | table
exit 0
