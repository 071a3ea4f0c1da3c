#!/usr/bin/env bash
# t1's bundle B, session 19 (issue 14's headline): the 28-layer decode replay at S = 8 (the
# target: step p50 <= 1.5 x (the step's bare gRPC round trips + its kernels)) and S = 64, with
# and without multi-weight calls, on main with this session's host-path changes (not measured
# since session 17's check: S=8 135.4 ms against 86.0). One bench/service.py --replay process
# (the model uploaded once; its JSON written after each run, so a cut keeps what finished);
# the targets' rows by bench/check_targets.py, the per-call split of each run after them.
#   bash bench/gpu_t1_s19b.sh   env: BOUND (58 s), RESERVE (5 s), SEQS (8,64), REPLAY_S (1.5)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s19b
BOUND=${BOUND:-58}
RESERVE=${RESERVE:-5}  # the worker's stop after a cut (SIGTERM: bench/service.py's finally) and the table
step replay 60 python3 bench/service.py --backend cuda --replay --replay-seqs "${SEQS:-8,64}" \
  --seconds "${REPLAY_S:-1.5}" --warmup 0.3 --json "$OUT/replay.json"
{
  echo "# gpu_t1_s19b $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# uploaded|^replay S=|per step p50|^    per call" "$OUT/replay.log" | cut -c1-200
  python3 bench/check_targets.py "$OUT" | grep -E "^# |^\| target|replay S="
} | table
exit 0
