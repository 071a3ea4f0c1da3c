#!/usr/bin/env bash
# t1's bundle A, session 18 (issue 14's replay; session 17's gpu_t1_s17b.sh, never run, rebased):
# the 28-layer replay (multi-weight calls, the lm-head's top-64, S = 1 and 8) under worker
# variants alternated in one call (bench/replay_ab.py: one worker per variant, the model uploaded
# to each once); by default the worker's GIL switch interval (Python's 5000 us against
# Q6SERVE_GIL_SWITCH_US=200: whether hp makes 200 the default). Then (no worker, no GPU) the
# step's calls in order against a bare echo, answered at once and held each role's window, the
# windows being this call's own: the "def" runs' handler p50 per role (bench/replay_echo.py
# --holds-from): if the held echo's round trip is the replay's, the replay's per-call cost beyond
# the window is Python gRPC's (issue 14's "which part of the floor is left and why").
#   bash bench/gpu_t1_s18a.sh   env: BOUND (78 s), VARIANTS, ORDER, SEQS (1,8), SPIN (0),
#   BACKEND (cuda), LAYERS (28), SCALE (1), HOLD_VARIANT (def), ECHO_S (14: kept for the echo)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s18a
BOUND=${BOUND:-78}
ECHO_S=${ECHO_S:-14}
limit=$(bound 80 "$((ECHO_S + 2))")
# replay_ab's own bound: no run starts that would end past it (its workers' stop and the
# table after it: 8 s kept)
step replay_ab "$limit" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-def: g200:Q6SERVE_GIL_SWITCH_US=200}" \
  --order "${ORDER:-def,g200,g200,def,def,g200}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --spin "${SPIN:-0}" --seconds 1.0 \
  --warmup 0.3 --bound "$((limit - 8))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
step replay_echo "$ECHO_S" python3 bench/replay_echo.py --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds-from "$OUT/replay_ab.json" \
  --holds-variant "${HOLD_VARIANT:-def}" --hold-fields kernel,device,handler --seconds 0.5 --spin "${SPIN:-0}" \
  --json "$OUT/replay_echo.json"
{
  echo "# gpu_t1_s18a $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-230
  grep -E "^# replay|^# no |^S=" "$OUT/replay_echo.log"
} | table
exit 0
