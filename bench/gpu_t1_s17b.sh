#!/usr/bin/env bash
# t1's bundle B, session 17 (issue 14's replay): the 28-layer replay (multi-weight calls, the
# lm-head's top-64, S = 1 and 8) under worker variants alternated in one call (bench/replay_ab.py:
# one worker per variant, the model uploaded to each once); by default the worker's GIL switch
# interval (Python's 5000 us against Q6SERVE_GIL_SWITCH_US=200: hp's goal 3 across T1, the
# lm-head and the replay). The replay's hosts account each call while the next is in flight.
# Then (no worker, no GPU) the step's calls in order against a bare echo, answered at once and
# held each role's window (bench/replay_echo.py; HOLDS: the worker's handler p50 per role in
# bundle A, medians of its runs): the transport a bare server with the worker's windows pays.
#   bash bench/gpu_t1_s17b.sh   env: BOUND (78 s), VARIANTS, ORDER, SEQS (1,8), SPIN (0),
#   BACKEND (cuda), LAYERS (28), SCALE (1), HOLDS
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s17b
BOUND=${BOUND:-78}
HOLDS=${HOLDS:-"1:q+k+v=211,o=89,gate+up=200,down=125,lm_head=263;8:q+k+v=287,o=128,gate+up=251,down=214,lm_head=312"}
step replay_echo 22 python3 bench/replay_echo.py --seqs "${SEQS:-1,8}" --layers "${LAYERS:-28}" \
  --scale "${SCALE:-1}" --holds "$HOLDS" --seconds 0.7 --spin "${SPIN:-0}" \
  --json "$OUT/replay_echo.json"
limit=$(bound 80 2)
# replay_ab's own bound: no run starts that would end past it (its workers' stop and the
# table after it: 8 s kept)
step replay_ab "$limit" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-def: g200:Q6SERVE_GIL_SWITCH_US=200}" \
  --order "${ORDER:-def,g200,g200,def,def,g200}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --spin "${SPIN:-0}" --seconds 1.0 \
  --warmup 0.3 --bound "$((limit - 8))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s17b $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ S=.*step p50" \
    "$OUT/replay_ab.log" | cut -c1-220
  grep -E "^# replay echo|^S=" "$OUT/replay_echo.log"
} | table
exit 0
