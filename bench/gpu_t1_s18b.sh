#!/usr/bin/env bash
# t1's bundle B, session 18 (issue 14's replay): one backend call per multi-weight call
# (Q6SERVE_MULTI_LAUNCH=1) against the parts' own calls (0, the default), alternated more often
# than session 14's two runs each, each worker pinned to its own core and the replay's host on
# others (session 14's two hosts disagreed: for it on one, S=8 115.4 -> 101.1 ms; against it on
# a noisy second, S=1 92.3 -> 124.5 ms; docs/SERVICE.md said the next call should do this).
# bench/replay_ab.py: one worker per variant, the 28-layer model uploaded to each once, the
# replay (multi-weight calls, the lm-head's top-64) at S = 8 and 1 per run.
#   bash bench/gpu_t1_s18b.sh   env: BOUND (78 s), VARIANTS, ORDER, SEQS (8,1), PIN (2,3:8-15;
#   empty: unpinned), SPIN (0), BACKEND (cuda), LAYERS (28), SCALE (1), SECS (1.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s18b
BOUND=${BOUND:-78}
limit=$(bound 80 2)
pin=()
[[ -n ${PIN-2,3:8-15} ]] && pin=(--pin "${PIN-2,3:8-15}")
# replay_ab's own bound: no run starts that would end past it (its workers' stop and the
# table after it: 8 s kept)
step replay_ab "$limit" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-off:Q6SERVE_MULTI_LAUNCH=0 one:Q6SERVE_MULTI_LAUNCH=1}" \
  --order "${ORDER:-off,one,one,off,off,one,one,off}" --seqs "${SEQS:-8,1}" "${pin[@]}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --spin "${SPIN:-0}" --seconds "${SECS:-1.0}" \
  --warmup 0.3 --bound "$((limit - 8))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s18b $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-230
} | table
exit 0
