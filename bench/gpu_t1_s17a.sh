#!/usr/bin/env bash
# t1's bundle A, session 17 (issue 14's replay): where a replay call's time goes beyond the bare
# round trip. The 28-layer replay with multi-weight calls and the lm-head's top-64 at S = 8 and 1,
# the worker's replies stamped (bench/reply_stamps.py: the transport split into the way up and
# the way down), the host's loop plain and busy-polling 1000 us alternated (--replay-spins), the
# bare-gRPC floor with a plain and a busy-polling echo, its caller spinning as the host does.
# Per call role p50: rpc, transport (up, down), handler (device, kernel), client.
#   bash bench/gpu_t1_s17a.sh   env: BOUND (78 s), SPINS (0,1000,0,1000), SEQS (8,1),
#   BACKEND (cuda), LAYERS (28), SCALE (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s17a
BOUND=${BOUND:-78}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} Q6SERVE_REPLY_STAMPS=1 step replay "$(bound 80 2)" \
  python3 bench/service.py --backend "${BACKEND:-cuda}" --replay --replay-seqs "${SEQS:-8,1}" \
  --multi on --replay-spins "${SPINS:-0,1000,0,1000}" --layers "${LAYERS:-28}" \
  --scale "${SCALE:-1}" --seconds 1.0 --warmup 0.3 --json "$OUT/replay.json"
{
  echo "# gpu_t1_s17a $(tree_commit) total $(elapsed)"
  steps
  grep -E "^replay|^    per|floor per step" "$OUT/replay.log" | cut -c1-200
} | table
exit 0
