#!/usr/bin/env bash
# Session 10 round 2 (issue 14/16, helper k), one device call: where the replay's device time
# outside the kernel goes. (1) bench/device_gap.py: the replay's 197 calls in-process (no
# service) in step order vs one weight repeated, back to back / with a 300 us spin / sleep
# between calls, N = 1 and 8, and Launcher.y16_graph off/on (a larger f16 y converted in the
# graph: the A/B of that change); (2) the service replay (S = 1 and 8, single-weight calls) with
# py-spy --native --idle recording the worker (raw stacks, for the device job's breakdown).
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/kreplay
python3 -m pip install -q --no-deps --no-compile --target /tmp/spy .whl/py_spy*.whl 2>/dev/null
SPY=/tmp/spy/bin/py-spy
note "# setup done at $(elapsed)"
timeout "${GAP_TIMEOUT:-45}" python3 bench/device_gap.py --ns 1,8 --gaps 0,spin300,sleep300 \
  --steps "${GAP_STEPS:-3}" --json "$OUT/gap.json" 2>&1 | tee "$OUT/gap.log"
note "# device_gap rc=${PIPESTATUS[0]} at $(elapsed)"
timeout "${REPLAY_TIMEOUT:-60}" python3 bench/service.py --backend cuda --replay --replay-seqs 1,8 \
  --multi off --seconds 2 --warmup 0.5 --no-replay-floor --json "$OUT/replay.json" \
  >"$OUT/replay.log" 2>&1 &
rp=$!
pid=$(worker_pid 80)
if [[ -n $pid && -x $SPY ]]; then
  $SPY record --pid "$pid" --native --idle -r "${SPY_RATE:-400}" -d "${SPY_SECONDS:-55}" -f raw \
    -o "$OUT/spy_worker.txt" >"$OUT/spy.log" 2>&1 &
fi
wait $rp
note "# replay rc=$? at $(elapsed)"
wait
grep -E "^replay|per step" "$OUT/replay.log" | head -8
cp "$OUT"/gap.log "$OUT"/gap.json "$OUT"/replay.log "$OUT"/spy_worker.txt "$OUT"/spy.log "$FINAL"/ 2>/dev/null
tar czf "$FINAL/kreplay.tgz" -C "$OUT" . 2>/dev/null
ls -la "$FINAL" | tail -9
