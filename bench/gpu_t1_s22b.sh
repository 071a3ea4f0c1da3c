#!/usr/bin/env bash
# t1's bundle B, session 22 (bound 50 s; issue 14 goal 1, the caller's side): on the replay (4
# layers + the lm-head's top-64: 17 calls a step, multi-weight, S = 1 and 8), alternated on one
# worker with its replies stamped: aio = grpc.aio's MatmulStream on the host's loop (the
# replay's host, upb + arrays), as = AsyncClient.session() with the client's decoding (what an
# async user runs; bundle A: S=1 9.83 / 12.83 against aio 10.63 ms, S=8 16.85 / 16.38), ss =
# Client.session() (a sync user's: the session's loop thread), isp = Client.session(thread=
# False, spin_us=2000) (the caller's thread runs the session's loop, polling without sleeping
# for the reply: bundle A's sp, the host's loop spinning 2000 us, took 9-12% off a step).
#   bash bench/gpu_t1_s22b.sh   env: BOUND (48 s), VARIANTS, ORDER, SEQS (1,8), BACKEND (cuda),
#   LAYERS (4), SCALE (1), SECONDS_RUN (0.6)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s22b
BOUND=${BOUND:-48}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
limit=$(bound 50 2)
# replay_ab's own bound: no run starts that would end past it (the worker's stop and the table
# after it: 5 s kept)
step replay_ab "$limit" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1 \
  python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-aio: as:host.transport=asession,host.decode=client ss:host.transport=session,host.decode=client isp:host.transport=isession,host.decode=client,host.spin=2000}" \
  --order "${ORDER:-aio,as,ss,isp,isp,ss,as,aio}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-4}" --scale "${SCALE:-1}" --seconds "${SECONDS_RUN:-0.6}" \
  --warmup 0.3 --bound "$((limit - 5))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
{
  echo "# gpu_t1_s22b $(tree_commit) total $(elapsed)"
  steps
  machine_summary
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED|not run)" \
    "$OUT/replay_ab.log" | cut -c1-400
} | table
exit 0
