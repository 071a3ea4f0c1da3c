#!/usr/bin/env bash
# t1's bundle A, session 22 (bound 70 s; issue 14 goals 1 and 2): T1 first (as the closing
# check runs it, the machine sampled meanwhile: session 21's check read 780 us on its first run,
# 392-535 on re-runs), then on the replay (4 layers + the lm-head's top-64: 17 calls a step,
# multi-weight, S = 1 and 8), alternated on one worker with its replies stamped, the caller's
# side: aio = grpc.aio's MatmulStream on the host's loop (the replay's host), as =
# AsyncClient.session() with the client's own decoding (what a user runs), p2 = the host's S
# sequences as 2 concurrent chains (S=8 only), sp = the host's loop busy-polling 2000 us (a
# spin as long as a call: the caller's wake-up share of a step), and T1 again last.
#   bash bench/gpu_t1_s22a.sh   env: BOUND (68 s), VARIANTS, ORDER, SEQS (1,8), BACKEND (cuda),
#   LAYERS (4), SCALE (1), SECONDS_RUN (0.6), T1_SECONDS (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s22a
BOUND=${BOUND:-68}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
t1() {  # T1 as bench/gpu_check.sh runs it (shorter)
  step "$1" "$2" python3 bench/service.py --backend "${BACKEND:-cuda}" --target-report \
    --targets T1 --modes stream --weights ffn_down --seconds "${T1_SECONDS:-1}" --warmup 0.3 \
    --json "$OUT/$1.json"
}
t1 t1_first 28
limit=$(bound 60 16)
# replay_ab's own bound: no run starts that would end past it (the worker's stop: 4 s kept)
step replay_ab "$limit" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1 \
  python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-aio: as:host.transport=asession,host.decode=client p2:host.chains=2 sp:host.spin=2000}" \
  --order "${ORDER:-aio,as,p2,sp,sp,p2,as,aio}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-4}" --scale "${SCALE:-1}" --seconds "${SECONDS_RUN:-0.6}" \
  --warmup 0.3 --bound "$((limit - 4))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
left 14 && t1 t1_last 14
{
  echo "# gpu_t1_s22a $(tree_commit) total $(elapsed)"
  steps
  machine_summary
  grep -hE "^T1 |mean us|bare gRPC round trip(, echo| with)" "$OUT"/t1_*.log | cut -c1-200
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED|not run)" \
    "$OUT/replay_ab.log" | cut -c1-400
} | table
exit 0
