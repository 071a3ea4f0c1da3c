#!/usr/bin/env bash
# t1's bundle B, session 21 (bound 50 s; issue 14, the caller's gRPC): the q6serve client's
# closed-loop sessions (client/session.py) against the raw transports bundle A compared, on the
# replay (4 layers + the lm-head's top-64: 17 calls a step, so a short run has steps enough;
# multi-weight calls, S = 1 and 8), alternated on one worker, its replies stamped:
# ss = Client.session() (grpc.aio's MatmulStream on the session's own loop thread, each call a
# blocking hand-off), is = Client.session(thread=False) (the same loop run by the caller's
# thread in each call: no hand-off), su = the sync stub's unary calls (what Client.matmul
# makes), aio = grpc.aio's MatmulStream on the host's loop (the replay's host; bench/replay_ab.py
# host.transport).
#   bash bench/gpu_t1_s21b.sh   env: BOUND (48 s), VARIANTS, ORDER, SEQS (1,8), BACKEND (cuda),
#   LAYERS (4), SCALE (1), SECONDS_RUN (0.6)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s21b
BOUND=${BOUND:-48}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
limit=$(bound 50 2)
# replay_ab's own bound: no run starts that would end past it (the worker's stop and the table
# after it: 6 s kept)
step replay_ab "$limit" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1 \
  python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-aio: is:host.transport=isession ss:host.transport=session su:host.transport=sync,host.mode=unary}" \
  --order "${ORDER:-aio,is,ss,su,ss,is,aio}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-4}" --scale "${SCALE:-1}" --seconds "${SECONDS_RUN:-0.6}" \
  --warmup 0.3 --bound "$((limit - 6))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s21b $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-400
} | table
exit 0
