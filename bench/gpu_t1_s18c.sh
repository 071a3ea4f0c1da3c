#!/usr/bin/env bash
# t1's bundle C, session 18 (issue 14's replay): hp's copy-kernel launch sequence (landed on by
# default, Q6SERVE_COPY_KERNEL_MAX 64 KiB: x's upload and a small y's download by a kernel, not
# the copy engine) on the 28-layer replay, against the copy engine (=0), alternated def, ce, ce,
# def at S = 8 and 1 (bench/replay_ab.py: one worker per variant, unpinned as bundle A).
#   bash bench/gpu_t1_s18c.sh   env: BOUND (58 s), VARIANTS, ORDER, SEQS (8,1), BACKEND (cuda),
#   LAYERS (28), SCALE (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s18c
BOUND=${BOUND:-58}
limit=$(bound 60 1)
step replay_ab "$limit" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-def: ce:Q6SERVE_COPY_KERNEL_MAX=0}" \
  --order "${ORDER:-def,ce,ce,def}" --seqs "${SEQS:-8,1}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --seconds 1.0 \
  --warmup 0.3 --bound "$((limit - 6))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s18c $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-230
} | table
exit 0
