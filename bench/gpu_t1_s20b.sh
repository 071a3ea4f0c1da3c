#!/usr/bin/env bash
# t1's bundle B, session 20 (bound 40 s): the client's replies read as views of their bytes
# (client/reply_bytes.py) against parsed whole, where the replies are large. (1) One caller's
# Client.matmul_full of the lm-head at N=64 with f32 y (39 MB replies: the issue's "39 MB of
# f32 logits per reply"), alternated in one process (bench/client_decode.py). (2) The replay
# at S=64 (4 layers + the lm-head's top-64, so a run has steps enough in a short call), the
# host decoding as the client does, views (cl) against whole (clcopy), alternated on one
# worker (bench/replay_ab.py): each role's caller encode + decode per call.
#   bash bench/gpu_t1_s20b.sh   env: BOUND (38 s), BACKEND (cuda), ROWS (152064), K (3584),
#   LAYERS (4), SCALE (1), SEQS (64)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s20b
BOUND=${BOUND:-38}
step client_decode 14 python3 bench/client_decode.py --backend "${BACKEND:-cuda}" \
  --rows "${ROWS:-152064}" --k "${K:-3584}" --n 64 --out f32 --calls 6 --rounds 4 \
  --log "$OUT/worker_client_decode.log" --json "$OUT/client_decode.json"
limit=$(bound 40 1)
step replay_ab "$limit" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "cl:host.decode=client clcopy:host.decode=client,host.view_min=1e18" \
  --order cl,clcopy,clcopy,cl --seqs "${SEQS:-64}" --layers "${LAYERS:-4}" \
  --scale "${SCALE:-1}" --seconds 0.8 --warmup 0.2 --bound "$((limit - 5))" --out-dir "$OUT" \
  --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s20b $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (uploaded|Client|whole)|^(views|whole) " "$OUT/client_decode.log"
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-600
} | table
exit 0
