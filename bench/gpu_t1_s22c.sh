#!/usr/bin/env bash
# t1's bundle C, session 22 (bound 40 s; issue 14 goal 1): the 28-layer replay as the closing
# check will run it from now on, its host the product's default caller (Client.session(): the
# session's loop run by the calling thread, spinning up to 2000 us for each reply on 8+ cores;
# bundle B: 10.3 / 14.5 ms a 4-layer step at S=1 / S=8 against 11.1 / 16.3 for grpc.aio on the
# host's loop) and its floor's echo caller spinning as long (like for like): S=8 (the target)
# first, then S=1, multi-weight calls, the worker's replies stamped.
#   bash bench/gpu_t1_s22c.sh   env: BOUND (38 s), SEQS (8,1), TRANSPORT (session), LAYERS (28),
#   SECONDS_RUN (1.0), BACKEND (cuda), SCALE (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s22c
BOUND=${BOUND:-38}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
# bench/service.py writes its JSON after each S: a run the bound cuts keeps the S it finished
step replay "$(bound 40 2)" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" \
  Q6SERVE_REPLY_STAMPS=1 python3 bench/service.py --backend "${BACKEND:-cuda}" --replay \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --replay-seqs "${SEQS:-8,1}" --multi on \
  --replay-transport "${TRANSPORT:-session}" --seconds "${SECONDS_RUN:-1.0}" --warmup 0.3 \
  --json "$OUT/replay.json"
{
  echo "# gpu_t1_s22c $(tree_commit) total $(elapsed)"
  steps
  machine_summary
  grep -E "^# uploaded|floor per step|^replay S=|caller gRPC|per step p50" "$OUT/replay.log" \
    | cut -c1-300
  grep -E "^    per call p50 us" "$OUT/replay.log" | cut -c1-200
} | table
exit 0
