#!/usr/bin/env bash
# t1's bundle A, session 21 (issue 14, the caller's gRPC): the 28-layer replay (multi-weight
# calls, the lm-head's top-64, S = 1 and 8) on one worker, its replies stamped (bench/trips_site:
# each call's way up and down), the replay host's gRPC alternated on that worker
# (bench/replay_ab.py host.* options): grpc.aio on MatmulStream (aio: the replay up to session
# 20), the sync stub on MatmulStream (sync: gRPC's request-iterator thread and the channel's
# poller hand each message over), the sync stub's blocking unary Matmul (syncu: C-core from the
# host's one thread, no loop, no hand-off; what Client.matmul does), and last, if the bound
# leaves time, grpc.aio's unary Matmul (aiou: AsyncClient.matmul's). Then (no worker, no GPU)
# the step's calls in order against the bare busy-polling echo with each caller transport: the
# floor each variant is judged on (bench/replay_echo.py --transport / --mode).
#   bash bench/gpu_t1_s21a.sh   env: BOUND (78 s), VARIANTS, ORDER, SEQS (1,8), BACKEND (cuda),
#   LAYERS (28), SCALE (1), ECHO_S (18: kept for the three echo runs)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s21a
BOUND=${BOUND:-78}
ECHO_S=${ECHO_S:-18}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
limit=$(bound 80 "$((ECHO_S + 2))")
# replay_ab's own bound: no run starts that would end past it (the worker's stop and the table
# after it: 8 s kept)
step replay_ab "$limit" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1 \
  python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-aio: sync:host.transport=sync syncu:host.transport=sync,host.mode=unary aiou:host.mode=unary}" \
  --order "${ORDER:-aio,syncu,sync,sync,syncu,aio,aiou}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --seconds 1.0 \
  --warmup 0.3 --bound "$((limit - 8))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
for tm in aio:stream sync:stream sync:unary; do
  t=${tm%%:*} m=${tm#*:}
  step "echo_${t}_$m" "$(bound $((ECHO_S / 3)))" python3 bench/replay_echo.py \
    --seqs "${SEQS:-1,8}" --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --seconds 0.3 \
    --transport "$t" --mode "$m" --json "$OUT/replay_echo_${t}_$m.json"
done
{
  echo "# gpu_t1_s21a $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-400
  for tm in aio_stream sync_stream sync_unary; do
    echo "# echo, caller $tm"; grep -E "^# replay echo|^# no " "$OUT/echo_$tm.log"
  done
} | table
exit 0
