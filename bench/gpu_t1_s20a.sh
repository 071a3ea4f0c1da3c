#!/usr/bin/env bash
# t1's bundle A, session 20 (issue 14's replay, the caller's side): the 28-layer replay (multi-
# weight calls, the lm-head's top-64, S = 1 and 8) on one worker, its replies stamped
# (bench/trips_site: each call's way up and down), the replay host's loop plain against busy-
# polling (host.spin=300: a caller-side variant, bench/replay_ab.py, alternated on the same
# worker); every call's figures per role: the worker's handler, the caller's encode + decode and
# its process's CPU in the call (ccpu); then the q6serve client's own stream decoding
# (host.decode=client: core.stream_outcome, replies from 256 KiB read as views of their bytes,
# client/reply_bytes.py) against the same with every reply parsed whole by upb (clcopy). Then
# (no worker, no GPU) the step's calls in order
# against a bare busy-polling echo, bare and held for the runs' handler p50 per role, with the
# caller plain and spinning (bench/replay_echo.py): the floor each host variant is judged on.
#   bash bench/gpu_t1_s20a.sh   env: BOUND (78 s), VARIANTS, ORDER, SEQS (1,8), BACKEND (cuda),
#   LAYERS (28), SCALE (1), ECHO_S (16: kept for the two echo runs)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/t1s20a
BOUND=${BOUND:-78}
ECHO_S=${ECHO_S:-16}
SITE=$PWD/bench/trips_site  # its sitecustomize installs the reply stamps in the worker
limit=$(bound 80 "$((ECHO_S + 2))")
# replay_ab's own bound: no run starts that would end past it (the worker's stop and the table
# after it: 8 s kept)
step replay_ab "$limit" env "PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}" Q6SERVE_REPLY_STAMPS=1 \
  python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-plain: spin:host.spin=300 cl:host.decode=client clcopy:host.decode=client,host.view_min=1e18}" \
  --order "${ORDER:-plain,spin,spin,plain,cl,clcopy,clcopy,cl}" --seqs "${SEQS:-1,8}" \
  --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --seconds 1.0 \
  --warmup 0.3 --bound "$((limit - 8))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
for spin in 0 300; do
  v=plain; ((spin)) && v=spin
  step "echo_spin$spin" "$(bound $((ECHO_S / 2)))" python3 bench/replay_echo.py --seqs "${SEQS:-1,8}" \
    --layers "${LAYERS:-28}" --scale "${SCALE:-1}" --holds-from "$OUT/replay_ab.json" \
    --holds-variant "$v" --hold-fields handler --seconds 0.4 --spin "$spin" \
    --json "$OUT/replay_echo_$spin.json"
done
{
  echo "# gpu_t1_s20a $(tree_commit) total $(elapsed)"
  steps
  grep -E "^# (the workers|[0-9]+ workers)|^# replay A/B|^# NVIDIA|^# S=|^[a-z0-9]+_[0-9]+ |^# [a-z0-9]+_[0-9]+ .*(skipped|FAILED)" \
    "$OUT/replay_ab.log" | cut -c1-400
  for spin in 0 300; do echo "# echo, caller spin $spin"; grep -E "^# replay|^# no |^S=" "$OUT/echo_spin$spin.log"; done
} | table
exit 0
