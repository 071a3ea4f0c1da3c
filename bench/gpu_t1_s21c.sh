#!/usr/bin/env bash
# t1's bundle C, session 21 (bound 40 s; issue 14, the caller's gRPC): bundle B (bb01485) put
# Client.session() (ss: grpc.aio's MatmulStream on the session's own loop thread, each call a
# blocking hand-off) between grpc.aio on the host's loop (aio) and the sync stub's unary calls;
# here the session run by the caller's own thread in each call (is: Client.session(thread=
# False), no hand-off) against aio and ss, alternated on one worker, its replies stamped, on the
# replay (4 layers + the lm-head's top-64: 17 calls a step; multi-weight; S = 1 and 8), and
# last, if the bound leaves time, as = AsyncClient.session() (bench/replay_ab.py host.transport).
#   bash bench/gpu_t1_s21c.sh   env: BOUND (38 s), VARIANTS, ORDER, SEQS (1,8), BACKEND (cuda),
#   LAYERS (4), SCALE (1), SECONDS_RUN (0.6)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s21c
BOUND=${BOUND:-38}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
limit=$(bound 40 2)
# replay_ab's own bound: no run starts that would end past it (the worker's stop and the table
# after it: 6 s kept)
step replay_ab "$limit" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1 \
  python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-is:host.transport=isession aio: ss:host.transport=session as:host.transport=asession}" \
  --order "${ORDER:-is,aio,ss,ss,aio,is,as}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-4}" --scale "${SCALE:-1}" --seconds "${SECONDS_RUN:-0.6}" \
  --warmup 0.3 --bound "$((limit - 6))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s21c $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-400
} | table
exit 0
